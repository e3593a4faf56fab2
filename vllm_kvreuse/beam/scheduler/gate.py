"""A group's step is admitted whole, or not at all.

A member inherits its parent's blocks and needs one new block (its
copy-on-write tail), so a step of ``k`` waiting members needs ``k`` free
blocks; members of a live group (:mod:`.live`) also need ``k`` free
running seats (``max_num_seqs``), as they run together from then on. If a
step's members were admitted one by one, some could hold blocks and seats
while their siblings wait for ones that never come; the group would wait
forever for its slowest member. So before each schedule every waiting
member of a step that does not fit the free blocks and seats as a whole is
held out of the queue for that step (oldest group first), and put back at
the head after it: the core's holds (:mod:`vllm_kvreuse.core.holds`) move
them, for the reason :data:`REASON`. A step that admits nothing is memory
pressure, which releases held beams (and preempts live members that wait
for a sibling), so this cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from vllm.v1.request import Request

from vllm_kvreuse.beam.scheduler.group import Phase

if TYPE_CHECKING:
    from vllm_kvreuse.beam.scheduler.group import BeamGroup
    from vllm_kvreuse.beam.scheduler.groups import GroupTable
    from vllm_kvreuse.core.context import Core
    from vllm_kvreuse.core.upstream.scheduler import Upstream

REASON = "beam step does not fit"
"""Why the gate holds a member (``core.holds``)."""


class Gate:
    """Holds the waiting members of steps that do not fit for one
    ``schedule()``: :meth:`hold` before it, :meth:`unhold` after it."""

    def __init__(self, core: Core) -> None:
        self.core = core

    def hold(self, groups: GroupTable) -> None:
        holds = self.core.holds
        holds.unhold_all(REASON)
        for request in steps_that_do_not_fit(self.core.upstream, groups, groups.get):
            holds.hold(request, REASON)

    def unhold(self) -> None:
        self.core.holds.unhold_all(REASON)


def steps_that_do_not_fit(
    upstream: Upstream,
    groups: Iterable[BeamGroup],
    group_of: Callable[[str], BeamGroup | None],
) -> list[Request]:
    """Every waiting member of a group whose step does not fit the free
    blocks (and, for a live group, the free seats), queue order.

    ``groups``: oldest first; ``group_of``: a root's or member's group. The
    caller holds them for one step (:class:`Gate`).
    """
    waiting: dict[str, list[Request]] = {}  # root id -> waiting members
    live: set[str] = set()  # groups whose members need seats at once
    for request in upstream.waiting_requests():
        group = group_of(request.request_id)
        if group is not None and request.request_id != group.root_id:
            waiting.setdefault(group.root_id, []).append(request)
            if group.phase is Phase.LIVE:
                live.add(group.root_id)
    if not waiting:
        return []
    free = upstream.num_free_blocks()
    seats = upstream.free_seats()
    parked: list[Request] = []
    for group in groups:  # oldest first
        members = waiting.get(group.root_id)
        if not members:
            continue
        needs_seats = group.root_id in live
        if len(members) <= free and (not needs_seats or len(members) <= seats):
            free -= len(members)
            seats -= len(members) if needs_seats else 0
        else:
            parked += members
    return parked
