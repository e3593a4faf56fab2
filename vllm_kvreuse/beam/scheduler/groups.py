"""Every beam group of one scheduler, and which group each request is of.

:class:`GroupTable` is the one owner of groups' membership and lifecycle:
a group starts here (:meth:`GroupTable.start`, its root indexed), its
member requests are spawned and indexed here (:meth:`GroupTable.spawn`), a
member that ended with its step leaves here (:meth:`GroupTable.forget`),
and a group ends here, with everything it holds (:meth:`GroupTable.drop`:
its live members aborted, its held blocks released, its beams forgotten by
the workers). Members are internal requests (:mod:`vllm_kvreuse.core.
internal`): each names its parent beam's request (``kvreuse_parent``),
whose held blocks it inherits.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from vllm_kvreuse.beam.scheduler.group import BeamGroup, Phase, member_request

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from vllm_kvreuse.beam.rule import BeamConfig
    from vllm_kvreuse.beam.scheduler.group_rule import PlainRule
    from vllm_kvreuse.core.context import Core
    from vllm_kvreuse.core.feature import Feature

OWNER = "beam"
"""The ledger owner of held beams."""


class GroupTable:
    """Groups by root id, oldest first; every root and member id -> its group.

    Invariants: a group is in the table from its root's arrival until
    :meth:`drop`; every request id indexed names a group in the table (drop
    unindexes all of them); ``ended`` holds the started live groups dropped
    since the last scheduler output, whose beams the workers still keep.
    """

    def __init__(self, core: Core, owner: Feature) -> None:
        self.core = core
        self._owner = owner
        self._hash_block_size = core.upstream.hash_block_size
        self._by_root: dict[str, BeamGroup] = {}
        self._of: dict[str, BeamGroup] = {}
        self._ended: list[str] = []

    def __len__(self) -> int:
        return len(self._by_root)

    def __iter__(self) -> Iterator[BeamGroup]:
        """The groups, oldest first (a snapshot: hooks may drop while iterating)."""
        return iter(list(self._by_root.values()))

    def is_empty(self) -> bool:
        """No group, and no request indexed."""
        return not self._by_root and not self._of

    def has(self, group: BeamGroup) -> bool:
        """Whether ``group`` is still in the table (not dropped)."""
        return self._by_root.get(group.root_id) is group

    def by_root(self, root_id: str) -> BeamGroup | None:
        """The group of root ``root_id``, while it is in the table (also
        once the root's own request has ended: :meth:`forget`)."""
        return self._by_root.get(root_id)

    def get(self, request_id: str) -> BeamGroup | None:
        """The group of a root or member request that has not ended."""
        return self._of.get(request_id)

    def roots(self, request_ids: Iterable[str]) -> list[BeamGroup]:
        """The groups whose roots are among ``request_ids``, oldest first."""
        ids = set(request_ids)
        return [g for root_id, g in self._by_root.items() if root_id in ids]

    def live(self) -> list[BeamGroup]:
        return [g for g in self._by_root.values() if g.phase is Phase.LIVE]

    # -- membership ----------------------------------------------------------------

    def start(self, root: Request, config: BeamConfig, rule: PlainRule) -> None:
        """A group whose one beam is ``root`` itself."""
        group = BeamGroup.start(root, config, rule)
        self._by_root[group.root_id] = group
        self._of[group.root_id] = group

    def spawn(
        self,
        group: BeamGroup,
        tokens: list[int],
        parent_id: str,
        index: int,
        extra_args: dict[str, Any],
    ) -> str:
        """Adds the request of beam ``index`` of the group's next step (its
        parent's blocks inherited, the tail copy-on-write); returns its id."""
        request = member_request(
            group, tokens, parent_id, index, extra_args, self._hash_block_size
        )
        group.num_forks += 1
        group.num_copied_blocks += bool((len(tokens) - 1) % self.core.block_size)
        self._of[request.request_id] = group
        self.core.internal.spawn(request, self._owner)
        return request.request_id

    def forget(self, request_id: str) -> None:
        """A root or member that ended with its step leaves the index."""
        self._of.pop(request_id, None)

    # -- lifecycle -----------------------------------------------------------------

    def drop(self, group: BeamGroup) -> None:
        """Ends ``group``: unindexes it and its requests, aborts its members
        (at the next safe point), releases the blocks it holds, and has the
        workers forget its beams (:meth:`take_ended`). A second call is a no-op."""
        if self._by_root.pop(group.root_id, None) is None:
            return
        requests = [rid for rid, owner in self._of.items() if owner is group]
        for request_id in requests:
            del self._of[request_id]
        if group.started:
            self._ended.append(group.root_id)
        self.free_held(group.beam_ids)
        self.core.abort(r for r in requests if r != group.root_id)

    def free_held(self, request_ids: list[str]) -> None:
        """Lets held beams' blocks go (a step's children have run, a reset,
        memory pressure, the group's end)."""
        self.core.ledger.release(request_ids)

    def holds_blocks(self, group: BeamGroup) -> bool:
        ledger = self.core.ledger
        return any(beam_id in ledger for beam_id in group.beam_ids)

    def take_ended(self) -> list[str]:
        """The started groups dropped since the last call (the workers must
        forget their beams)."""
        ended, self._ended = self._ended, []
        return ended
