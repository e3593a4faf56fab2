"""Live groups stepped as one: members the host does not walk one by one.

A live group's members (:mod:`.live`) are ``width`` engine requests. Left
to upstream's loop, every step the scheduler walks each of them (its
queue, its slots, its budget), upstream's ``update_from_output`` appends
each one's token, checks its stops and makes its output, and the feature
reads those outputs: a group of width W costs the host W requests a step.

Stepped as one, the group costs it one: before the members' first step,
the group admits them itself, each with the blocks of every position it
will compute (:meth:`OneRequestSteps._admit`; a group upstream admitted
reserves them right after that step is scheduled, :meth:`~OneRequestSteps.take`);
from then on the members are held out of upstream's ``schedule()`` for
good (the core's holds, seats and all), and after each ``schedule()`` the
group's whole step is added to the output as extra rows
(:mod:`vllm_kvreuse.core.upstream.extra_rows`; the first sent whole), its
token budget borrowed before it. Upstream's update never walks them; the
workers apply the step (:mod:`~vllm_kvreuse.beam.worker.job`) and the
feature keeps its back-pointers (:mod:`.lineage`), from the members' first
step on.

A group that cannot be reserved whole (the pool, the token budget,
pipeline parallelism), one with a LoRA adapter (upstream's ``max_loras``
count cannot see held members), or one whose member upstream preempts (a
cache reset that preempts running requests), stays or goes back to the
member by member path of :mod:`.live` and :mod:`.sit_out`: same steps, same beams.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np
from vllm.entrypoints.generate.beam_search.utils import BeamSearchSequence
from vllm.v1.request import Request, RequestStatus

from vllm_kvreuse.beam.plan import GroupResult, GroupStep
from vllm_kvreuse.beam.rule import best
from vllm_kvreuse.beam.scheduler.group import Phase
from vllm_kvreuse.beam.scheduler.lineage import Lineage
from vllm_kvreuse.core.upstream.extra_rows import extra_rows

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

    from vllm_kvreuse.beam.scheduler.group import BeamGroup
    from vllm_kvreuse.beam.scheduler.groups import GroupTable
    from vllm_kvreuse.core.context import Core

_STATUS = attrgetter("status")

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
        if group.as_one or not self._may_step_as_one(group) or not members:
            return
        if group.config.width > self._rows.token_budget():
            return
        remaining = group.prompt_len + group.config.max_tokens - 1
        num_tokens = remaining - members[0].num_computed_tokens
        if num_tokens <= 0:  # the first step is the last
            return
        upstream = self.core.upstream
        end = -(-remaining // upstream.block_size)
        missing = [
            sum(max(0, end - len(t)) for t in upstream.blocks_of(member.request_id))
            for member in members
        ]
        # All or nothing: the workers learn a block from the row that first
        # uses it, and upstream's path would never send a reserved one.
        if sum(missing) > upstream.num_free_blocks():
            return
        # A member whose blocks cover every position left has nothing to
        # reserve (a search that ends in the block it starts in: no call).
        for member in itertools.compress(members, missing):
            ids = upstream.reserve(member, num_tokens)
            if ids is None:
                raise RuntimeError("free blocks counted for a beam group vanished")
            if any(ids):
                group.new_blocks[member.request_id] = ids
        self._step_as_one(group, members)

    def _admit(self, group: BeamGroup) -> None:
        """Before ``schedule()``: a live group whose members all wait for
        their first step is admitted whole here, not by upstream a member at
        a time: each member gets its parent's blocks for their common prefix
        (as upstream's lookup gives them) and its own for every position it
        will compute, runs, and is held from now on; its first row goes to
        the workers whole (:meth:`add_rows`). A group that cannot be
        admitted whole (seats, blocks, a member not waiting, a KV connector)
        is left to upstream (the gate, then :meth:`take`)."""
        upstream = self.core.upstream
        if group.started or not self._may_step_as_one(group):
            return
        found = [upstream.requests.get(rid) for rid in group.members]
        members = [m for m in found if m and m.status == RequestStatus.WAITING]
        if len(members) < len(found) or len(members) > upstream.free_seats():
            return
        positions = group.prompt_len + group.config.max_tokens - 1
        admitted = []
        for member in members:
            hit = self.core.ledger.inherited_hit(member)
            if hit is None or hit[1] >= positions:
                return
            admitted.append((member, hit[0], hit[1]))
        size = upstream.block_size
        needed = sum(-(-positions // size) - num // size for _, _, num in admitted)
        fits = members and needed <= upstream.num_free_blocks()
        if fits and upstream.admit(admitted, positions):
            self._step_as_one(group, members)
            group.unsent = True

    def _may_step_as_one(self, group: BeamGroup) -> bool:
        """Extra rows are possible (no pipeline parallelism), and the group
        has no LoRA adapter: held members are invisible to upstream's
        ``max_loras`` count, so their rows could take a batch past it."""
        return self._rows.supported and group.root.lora_request is None

    def _step_as_one(self, group: BeamGroup, members: list[Request]) -> None:
        """From the next ``schedule()`` on, the group's members are out of
        upstream's loop and its steps are added whole."""
        upstream = self.core.upstream
        group.tables = [upstream.block_ids_of(rid) for rid in group.members]
        group.held = members
        for member in members:
            self.core.holds.hold(member, REASON)
        group.as_one = True
        self.num_taken += 1

    def take_started(self, steps: list[GroupStep]) -> None:
        """Takes every group whose members' first step ``steps`` plans."""
        for step in steps:
            group = self._groups.by_root(step.group_id)
            if step.kind == "start" and group is not None:
                self.take(group)

    def count_rows(self, scheduler_output: SchedulerOutput) -> None:
        """The tokens a step's extra rows computed (they have no outputs
        of their own to count them)."""
        rows = extra_rows(scheduler_output)
        for group in self._groups:
            if group.members and group.members[0] in rows:
                group.num_member_computed_tokens += len(group.members)
                group.num_steps_as_one += 1

    def leave(self, request: Request) -> None:
        """A member was preempted: its group goes back to member by member
        (its beams and its members' histories built first)."""
        group = self._groups.get(request.request_id)
        if group is not None and group.as_one:
            self.sync(group)
            group.as_one = False
            group.tables = group.held = group.private = None
            for request_id in group.members:
                self.core.holds.unhold(request_id, REASON)
                if group.unsent:  # upstream would run them as known ones
                    self.core.resends.resend(request_id)
            group.unsent = False

    # -- its steps, as back-pointers (:mod:`.lineage`) -----------------------------

    @staticmethod
    def follows_lazily(group: BeamGroup) -> bool:
        """Whether the group's next result is kept as back-pointers: every
        member step while stepped as one, the members' first included
        (an extra row, or upstream's for a group it admitted)."""
        return group.as_one and group.step >= 1

    def advance(
        self, group: BeamGroup, result: GroupResult
    ) -> list[BeamSearchSequence] | None:
        """Applies a step the workers ran (they moved the beams onto their
        members): records it; returns the final beams if the group ends."""
        lineage = group.lineage
        if lineage is None:
            # Members begin with no output (their beam's tokens are their
            # prompt); from a later step, upstream holds each one's tokens
            # up to the step it last ran.
            first = self.core.upstream.requests[group.members[0]]
            outputs = 0 if group.step == 1 else first.num_output_tokens
            lineage = group.lineage = Lineage.begin(group.beams, outputs)
        if group.step + 1 < group.config.max_tokens:  # the last copies nothing
            self._count_moves(group, lineage, result)
        nodes = group.rule.next_nodes(lineage.nodes, result.parents, result.tokens)
        lineage.record(result, nodes, group.config.eos_token_id)
        group.step += 1
        if group.step < group.config.max_tokens and result.parents:
            return None
        return best(
            [*group.completed, *lineage.completed(group.config)],
            lineage.sequences(),
            group.config,
        )

    def _count_moves(
        self, group: BeamGroup, lineage: Lineage, result: GroupResult
    ) -> None:
        """The step's beams that moved onto another member, and the blocks
        the workers copied for them."""
        before = lineage.current_carriers(group.members)
        was = np.asarray(before)[np.asarray(result.parents, dtype=np.int64)]
        moved = int((was != np.asarray(result.carriers)).sum())
        size, start = self.core.block_size, group.prompt_len
        length = start + group.step  # each member's tokens, before this step's
        group.num_forks += moved
        group.num_copied_blocks += moved * (-(-length // size) - start // size)

    def sync(self, group: BeamGroup) -> None:
        """Builds the group's beams from its back-pointers, and each
        member's token history: its beam's (a member that carries none:
        the first beam's, at the same length); then forgets them."""
        lineage = group.lineage
        if lineage is None:
            return
        group.beams = lineage.beams(group.members)
        group.completed += lineage.completed(group.config)
        group.lineage = None
        carried = {beam.request_id: beam.seq.tokens for beam in group.beams}
        requests = self.core.upstream.requests
        for request_id in group.members:
            member = requests.get(request_id)
            if member is not None:
                tokens = carried.get(request_id, group.beams[0].seq.tokens)
                self.core.upstream.rewrite(member, group.prompt_len, tokens)

    # -- around one schedule() -----------------------------------------------------

    def hold(self, groups: Iterable[BeamGroup]) -> None:
        """Before ``schedule()``: the groups whose next step is due and
        fits the token budget (oldest first) borrow it. (Their members are
        held out of every ``schedule()`` from :meth:`take` to :meth:`leave`
        or their end.)"""
        budget = self._rows.token_budget()
        self.stepping = []
        for group in groups:
            if group.phase is not Phase.LIVE:
                continue
            if not group.as_one and group.config.width <= budget:
                self._admit(group)
            if not group.as_one:
                continue
            members = self._members(group)
            if members is None:
                continue
            if self._due(group, members) and group.config.width <= budget:
                budget -= group.config.width
                self.stepping.append(group)
        self._rows.borrow_tokens(sum(g.config.width for g in self.stepping))

    def add_rows(self, output: SchedulerOutput) -> None:
        """After ``schedule()``: the picked groups' steps, one row a member."""
        requests = self.core.upstream.requests
        for group in self.stepping:
            if not (self._groups.has(group) and group.as_one):
                continue
            members = group.held or [requests[rid] for rid in group.members]
            if group.unsent:  # admitted before this schedule()
                self._rows.add(output, members, {}, tables=group.tables)
                group.unsent = False
                continue
            if not all(map(self._rows.ran_last_step, group.members)):
                self.sync(group)  # the workers get its members' lists whole
            lineage = group.lineage
            count = lineage.outputs + lineage.num_steps if lineage else None
            self._rows.add(output, members, group.new_blocks, count)
        self.stepping = []

    # -- helpers -------------------------------------------------------------------

    def _members(self, group: BeamGroup) -> list[Request] | None:
        """The group's members, if every one is running (those it took
        when stepped as one: a member that ends or is preempted is no longer
        running, and none is ever replaced under its id)."""
        members = group.held
        if members is None:
            requests = self.core.upstream.requests
            found = [requests.get(rid) for rid in group.members]
            if None in found:
                return None
            members = found  # type: ignore[assignment]
        if set(map(_STATUS, members)) != {RequestStatus.RUNNING}:
            return None
        return members

    @staticmethod
    def _due(group: BeamGroup, members: list[Request]) -> bool:
        """The group has a step left to compute (its members move in
        lockstep: the first one's position is every one's)."""
        last = group.prompt_len + group.config.max_tokens - 1
        return members[0].num_computed_tokens < last
