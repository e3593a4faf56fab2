"""Live beams: one engine request per beam for the whole search.

After the group's first step (its members are spawned as children of the
root), a member request is never finished by a step. Each step runs next
to the logits (:mod:`.worker`): the worker picks the next beams and which
member carries each (:func:`vllm_kvreuse.beam.select.carriers`), and sets
each carrier's sampled token to its beam's token. The scheduler then
*re-seats* (:mod:`vllm_kvreuse.core.reseat`) each member whose beam moved:

- a parent's first child keeps the parent's request: its KV stays where it
  is, and its sampled token already is the child's;
- every further child takes the request of a parent that has no child
  (a *spare*): the parent's full blocks by reference, its partial tail
  copy-on-write, all copies of a step in one batch;
- spares left over are aborted (fewer beams: a narrow catalog prefix);
- a child with no spare left (more beams than members) is forked the old
  way: its parent is held in the ledger and a new member is spawned.

A group's step needs every member's row in one batch. So before each
``schedule()`` the members of a group that cannot step whole sit out
(:func:`to_hold`): its last step's result is not in yet (async
scheduling), or a member is not ready (waiting, or still recomputing after
a preemption; a recompute stops one token short, :func:`cap`). A member
that runs anyway outside a group step (upstream cut the batch) has that
sample taken back when its output comes (``BeamGroup.outside``).

This module only decides; :mod:`vllm_kvreuse.core.upstream` and
:mod:`vllm_kvreuse.core.reseat` apply it to upstream's state.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING

from vllm.v1.request import Request, RequestStatus

from vllm_kvreuse.beam.policy import Beam, Step
from vllm_kvreuse.core.reseat import Move

if TYPE_CHECKING:
    from vllm_kvreuse.beam.group import BeamGroup
    from vllm_kvreuse.beam.members import Members
    from vllm_kvreuse.core.context import Core
    from vllm_kvreuse.core.upstream import Upstream

OWNER = "beam"
"""The ledger owner of held beams."""


def carriers(
    parents: list[str], children: list[str]
) -> tuple[list[str | None], list[str]]:
    """Which request carries each next beam (the host's statement of the
    worker's :func:`vllm_kvreuse.beam.select.carriers`).

    ``parents``: this step's members, in beam order; ``children``: for each
    next beam, in order, its parent's member. Returns, for each child, its
    parent's member if it is that parent's first child, else None; and the
    spares (members whose beam has no child), in beam order.
    """
    taken: set[str] = set()
    rows: list[str | None] = []
    for parent in children:
        if parent in taken:
            rows.append(None)
        else:
            taken.add(parent)
            rows.append(parent)
    return rows, [p for p in parents if p not in taken]


def ready(request: Request | None) -> bool:
    """Running with exactly one token to compute: the group step's row."""
    return (
        request is not None
        and request.status == RequestStatus.RUNNING
        and request.num_tokens_with_spec
        + request.num_output_placeholders
        - request.num_computed_tokens
        == 1
    )


def to_hold(upstream: Upstream, groups: Iterable[BeamGroup]) -> list[Request]:
    """The running members of every live group that cannot step whole this
    ``schedule()`` (all of them while a step is in flight, else those
    ready while a sibling is not: a sibling still recomputing runs), in
    queue order: they sit out (:meth:`Upstream.hold`), keeping their seats."""
    requests = upstream.requests
    blocked: set[str] = set()
    for group in groups:
        members = group.member_ids
        if group.in_flight or group.outside:
            blocked.update(members)
            continue
        ready_ones = [rid for rid in members if ready(requests.get(rid))]
        if len(ready_ones) < len(members):
            blocked.update(ready_ones)
    if not blocked:
        return []
    return [r for r in upstream.running_requests() if r.request_id in blocked]


def cap(request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
    """A recomputing member stops one token short of its end, so that its
    last token runs with its siblings' (a group step); a member with one
    token left runs it."""
    left = request.num_tokens - num_computed_tokens
    if left > 1 and num_computed_tokens + num_new_tokens >= request.num_tokens:
        return left - 1
    return num_new_tokens


def stalled(
    requests: Mapping[str, Request], group: BeamGroup, held: Collection[str]
) -> list[Request]:
    """The group's members that sat out this ``schedule()`` (``held``) while
    a sibling waits (for blocks or a seat they may hold); empty when every
    member runs. Members the step scheduled are never named: their step
    runs."""
    members = [requests.get(rid) for rid in group.member_ids]
    if all(r is not None and r.status == RequestStatus.RUNNING for r in members):
        return []
    return [
        r
        for r in members
        if r is not None and r.status == RequestStatus.RUNNING and r.request_id in held
    ]


class LiveSteps:
    """The step strategy of live groups: spawns the members once, then
    re-seats them onto the beams the worker chose."""

    def __init__(self, core: Core, members: Members) -> None:
        self.core = core
        self._members = members

    def start(self, group: BeamGroup, step: Step, nodes: list[int]) -> list[Beam]:
        """The first beams (from the root's step) as new live members."""
        return [
            Beam(seq, self._members.spawn(group, seq.tokens, pid, i, {}),
                 nodes[i] if nodes else 0)
            for i, (seq, pid) in enumerate(step.beams)
        ]  # fmt: skip

    def apply(
        self, group: BeamGroup, step: Step, nodes: list[int], carried_by: list[int]
    ) -> list[Beam]:
        """Carries the next beams on the members the worker chose: a
        parent's first child stays, others move onto a spare, beyond the
        spares new members fork; unused members are aborted."""
        requests = self.core.scheduler.requests
        reseats = self.core.reseats
        members = group.member_ids
        pairs = list(zip(carried_by, step.beams, strict=True))
        moved = {c for c, (_, pid) in pairs if c >= 0 and members[c] != pid}
        # Every seat is read before any member changes.
        seats = {
            pid: reseats.seat_of(requests[pid]) for c, (_, pid) in pairs if c in moved
        }
        moves: list[Move] = []
        next_beams: list[Beam] = []
        for i, (c, (seq, pid)) in enumerate(pairs):
            token = seq.tokens[-1]
            if c < 0:  # more beams than members: fork
                if pid not in self.core.ledger:
                    self.core.ledger.hold(requests[pid], OWNER)
                rid = self._members.spawn(group, seq.tokens, pid, i, {})
            else:
                request = requests[members[c]]
                if c in moved:
                    moves.append(Move(request, seats[pid], token))
                    group.num_forks += 1
                elif request.all_token_ids[-1] != token:
                    moves.append(Move(request, None, token))
                rid = request.request_id
            next_beams.append(Beam(seq, rid, nodes[i] if nodes else 0))
        copied = reseats.num_copied_blocks
        reseats.move(moves)
        group.num_copied_blocks += reseats.num_copied_blocks - copied
        spares = set(members) - {beam.request_id for beam in next_beams}
        self._members.forget(spares)  # fewer beams than members
        self.core.abort(spares)
        return next_beams

    def rewind(self, request_id: str) -> None:
        """Takes back a member's sample made outside a group step: the token,
        and (running) the position that computed it, which its next group
        step computes again; the workers get the member whole."""
        request = self.core.scheduler.requests.get(request_id)
        if request is None:
            return
        self.core.upstream.unsample(request)
        if request.status == RequestStatus.RUNNING:
            self.core.reseats.move([Move(request, None, request.all_token_ids[-1])])


def stepping(
    groups: Iterable[BeamGroup], scheduled: Mapping[str, int],
    requests: Mapping[str, Request],
) -> list[BeamGroup]:  # fmt: skip
    """The root and live groups whose step a scheduler output runs whole
    (every beam's row samples); members it runs outside a group step are
    noted in their group (``BeamGroup.outside``)."""
    whole = []
    for group in groups:
        samples = [
            rid in scheduled and not requests[rid].is_prefill_chunk
            for rid in group.member_ids
        ]
        if all(samples):
            group.in_flight += 1
            whole.append(group)
        else:
            ran = zip(group.member_ids, samples, strict=True)
            group.outside.update(rid for rid, on in ran if on)
    return whole
