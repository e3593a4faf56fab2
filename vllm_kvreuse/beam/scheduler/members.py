"""A beam search's requests: the root and the member requests it spawns.

Members are internal requests (:mod:`vllm_kvreuse.core.internal`): each
names its parent beam's request (``kvreuse_parent``), whose held blocks it
inherits. :class:`Members` spawns them and indexes every root and member
by request id, so that hooks find a request's group.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm_kvreuse.beam.scheduler.group import BeamGroup, member_request

if TYPE_CHECKING:
    from vllm_kvreuse.core.context import Core
    from vllm_kvreuse.core.feature import Feature


class Members:
    """Roots and members by request id; spawns members for a feature."""

    def __init__(self, core: Core, owner: Feature) -> None:
        self.core = core
        self._owner = owner
        self._hash_block_size = core.upstream.hash_block_size
        self.group_of: dict[str, BeamGroup] = {}

    def get(self, request_id: str) -> BeamGroup | None:
        return self.group_of.get(request_id)

    def add(self, request_id: str, group: BeamGroup) -> None:
        self.group_of[request_id] = group

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.group_of.pop(request_id, None)

    def of(self, group: BeamGroup) -> list[str]:
        """Every request id indexed for ``group`` (its root included)."""
        return [rid for rid, owner in self.group_of.items() if owner is group]

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
        self.group_of[request.request_id] = group
        self.core.internal.spawn(request, self._owner)
        return request.request_id
