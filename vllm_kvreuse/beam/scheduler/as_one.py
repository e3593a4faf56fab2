"""Live groups stepped as one: members the host does not walk one by one.

A live group's members (:mod:`.live`) are ``width`` engine requests. Left
to upstream's loop, every step the scheduler walks each of them (its
queue, its slots, its budget), upstream's ``update_from_output`` appends
each one's token, checks its stops and makes its output, and the feature
reads those outputs: a group of width W costs the host W requests a step.

Stepped as one, the group costs it one: once the members' first step is
scheduled, the blocks of every position they will compute are reserved
(:meth:`OneRequestSteps.take`); from then on the members are held out of
upstream's ``schedule()`` for good (the core's holds, seats and all), and
after each ``schedule()`` the group's whole step is added to the output
as extra rows (:mod:`vllm_kvreuse.core.upstream.extra_rows`), its token
budget borrowed before it. Upstream's update never walks them; the
workers apply the step (:mod:`~vllm_kvreuse.beam.worker.job`) and the
feature follows as for any live step (:meth:`.live.LiveSteps.apply`).

A group that cannot be reserved whole (the pool, the token budget,
pipeline parallelism), or one whose member upstream preempts (a cache
reset that preempts running requests), stays or goes back to the member
by member path of :mod:`.live` and :mod:`.sit_out`: same steps, same beams.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from vllm.v1.request import Request, RequestStatus

from vllm_kvreuse.beam.scheduler.group import Phase

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

    from vllm_kvreuse.beam.scheduler.group import BeamGroup
    from vllm_kvreuse.beam.scheduler.groups import GroupTable
    from vllm_kvreuse.core.context import Core

REASON = "beam group stepped as one"
"""Why a member of a group stepped as one is out of upstream's loop."""


class OneRequestSteps:
    """Takes live groups out of upstream's loop and adds their steps.

    ``stepping``: the groups whose step the ``schedule()`` in progress adds
    (:meth:`hold` picks them before it, :meth:`add_rows` adds them after).
    """

    def __init__(self, core: Core, groups: GroupTable) -> None:
        self.core = core
        self._groups = groups
        self._rows = core.extra_rows
        self.stepping: list[BeamGroup] = []
        self.num_taken = 0  # groups stepped as one (a metric of the tests)

    def take(self, group: BeamGroup) -> None:
        """Right after the members' first step is scheduled: reserves the
        blocks of every position they will compute, and steps the group as
        one from the next ``schedule()`` on. Leaves it member by member if
        the pool cannot give them all."""
        members = self._members(group)
        if not self._rows.supported or members is None or not members:
            return
        if group.config.width > self._rows.token_budget():
            return
        remaining = group.prompt_len + group.config.max_tokens - 1
        num_tokens = remaining - members[0].num_computed_tokens
        if num_tokens <= 0:  # the first step is the last
            return
        upstream = self.core.upstream
        end = -(-remaining // upstream.block_size)
        needed = sum(
            end - len(table)
            for member in members
            for table in upstream.blocks_of(member.request_id)
        )
        # All or nothing: the workers learn a block from the row that first
        # uses it, and upstream's path would never send a reserved one.
        if needed > upstream.num_free_blocks():
            return
        for member in members:
            ids = upstream.reserve(member, num_tokens)
            if ids is None:
                raise RuntimeError("free blocks counted for a beam group vanished")
            if any(ids):
                group.new_blocks[member.request_id] = ids
        group.tables = [upstream.block_ids_of(rid) for rid in group.members]
        group.as_one = True
        self.num_taken += 1

    def leave(self, request: Request) -> None:
        """A member was preempted: its group goes back to member by member."""
        group = self._groups.get(request.request_id)
        if group is not None and group.as_one:
            group.as_one, group.tables = False, None

    # -- around one schedule() -----------------------------------------------------

    def hold(self, groups: Iterable[BeamGroup]) -> None:
        """Before ``schedule()``: every member of a group stepped as one is
        out of it; the groups whose next step is due and fits the token
        budget (oldest first) borrow it."""
        holds = self.core.holds
        holds.release_all(REASON)
        budget = self._rows.token_budget()
        self.stepping = []
        for group in groups:
            if group.phase is not Phase.LIVE or not group.as_one:
                continue
            members = self._members(group)
            if members is None:
                continue
            for member in members:
                holds.hold(member, REASON)
            if self._due(group, members) and group.config.width <= budget:
                budget -= group.config.width
                self.stepping.append(group)
        self._rows.borrow_tokens(sum(g.config.width for g in self.stepping))

    def add_rows(self, output: SchedulerOutput) -> None:
        """After ``schedule()``: the picked groups' steps, one row a member."""
        requests = self.core.upstream.requests
        for group in self.stepping:
            if self._groups.has(group) and group.as_one:
                members = [requests[rid] for rid in group.members]
                self._rows.add(output, members, group.new_blocks)
        self.stepping = []

    # -- helpers -------------------------------------------------------------------

    def _members(self, group: BeamGroup) -> list[Request] | None:
        """The group's members, if every one is running."""
        requests = self.core.upstream.requests
        members = [requests.get(rid) for rid in group.members]
        if any(m is None or m.status != RequestStatus.RUNNING for m in members):
            return None
        return members  # type: ignore[return-value]

    @staticmethod
    def _due(group: BeamGroup, members: list[Request]) -> bool:
        """The group has a step left to compute (its members move in
        lockstep: the first one's position is every one's)."""
        last = group.prompt_len + group.config.max_tokens - 1
        return members[0].num_computed_tokens < last
