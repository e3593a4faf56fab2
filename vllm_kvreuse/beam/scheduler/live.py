"""Live beams: one engine request per place for the whole search.

After the root's step a live group spawns ``width`` members, children of
the root (its full blocks by reference, its partial tail copy-on-write),
and keeps them to its last step: each carries one beam, or none while the
group has fewer beams than places. A member never finishes with a step.

Each step runs next to the logits (:mod:`~vllm_kvreuse.beam.worker.job`) and
the workers apply it themselves: they keep the group's beams (which member
carries which, the scores, the trie nodes), pick the next beams, give each
to a member (a parent's first child stays on the parent's member; every
other child takes a *spare*, a member whose beam has no child, then an idle
one), set each carrier's sampled token to its beam's token, and copy a moved
beam's parent's private KV blocks (past the prompt's full blocks, which all
share) into the member that takes it. So the next step needs nothing from
the scheduler and runs at once, with async scheduling too: a group advances
one token per engine step. The scheduler's requests follow when the result
comes (:meth:`LiveSteps.apply`: a moved member's token history becomes its
new parent's); block tables never change, and a member's blocks past the
prompt hash privately (never a prefix-cache hit for anyone), since their
content changes when the member moves.

A step needs every member's row in one batch: which members sit out a
``schedule()`` for their group is :mod:`.sit_out`'s. A member that
upstream's loop runs anyway outside a group step (a preemption inside
``schedule()`` cut the batch) has that sample taken back when its output
comes (:meth:`LiveSteps.rewind`).

:class:`LiveSteps` owns the live-step state that lives between hooks:
the members held out of one ``schedule()``, the last schedule's held ones,
and the samples of the output being read that were made outside a group
step. This module decides; the core applies (its holds,
:mod:`vllm_kvreuse.core.holds`, move held members out of the running queue
and back; :mod:`vllm_kvreuse.core.upstream` changes the requests).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from vllm.v1.request import Request

from vllm_kvreuse.beam.plan import GroupResult, GroupStep, outside_of, put_outside
from vllm_kvreuse.beam.rule import Beam, Step
from vllm_kvreuse.beam.scheduler.group import Phase
from vllm_kvreuse.beam.scheduler.sit_out import REASON, stalled, to_hold

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.engine import EngineCoreOutput

    from vllm_kvreuse.beam.scheduler.group import BeamGroup
    from vllm_kvreuse.beam.scheduler.groups import GroupTable
    from vllm_kvreuse.core.context import Core


def carriers(
    parents: list[str], children: list[str]
) -> tuple[list[str | None], list[str]]:
    """Which request carries each next beam (the host's statement of the
    worker's :func:`vllm_kvreuse.beam.worker.select.carriers`).

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


class LiveSteps:
    """The step strategy of live groups: spawns ``width`` members once;
    each step the workers put the next beams on them
    (:mod:`~vllm_kvreuse.beam.worker.job`), and the scheduler's requests
    follow.

    Live-step state, changed only here: ``held``, the running members held
    out of one ``schedule()`` (:meth:`hold` before it, :meth:`unhold` after
    it); ``sat_out``, the ids the last ``schedule()`` held (:meth:`stalled`
    reads them under memory pressure); ``outside_now``, the members whose
    sample in the output being read was made outside a group step
    (:meth:`outputs_arrive` sets it, :meth:`take_back` takes each back).
    """

    def __init__(self, core: Core, groups: GroupTable) -> None:
        self.core = core
        self._groups = groups
        # Members that took another beam (KV copied), member by member (a
        # group stepped as one counts its own in ``group.num_forks``).
        self.num_moved = 0
        self.held: list[Request] = []
        self.sat_out: set[str] = set()
        self.outside_now: set[str] = set()

    # -- around one schedule() -----------------------------------------------------

    def hold(self, groups: Iterable[BeamGroup]) -> None:
        """Holds the live groups' members that cannot step whole out of one
        ``schedule()``, seats and all (:func:`to_hold`; ``core.holds``
        takes them out of the running queue)."""
        holds = self.core.holds
        holds.unhold_all(REASON)
        self.held = to_hold(self.core.upstream, groups)
        for request in self.held:
            holds.hold(request, REASON)

    def unhold(self) -> None:
        """After the ``schedule()``: the held members run again from the
        next one (``core.holds`` has put them back at the head)."""
        self.sat_out = {r.request_id for r in self.held}
        self.held = []
        self.core.holds.unhold_all(REASON)

    def plan(
        self, groups: Iterable[BeamGroup], output: SchedulerOutput
    ) -> list[GroupStep]:
        """The steps ``output`` runs next to the logits: the root and live
        groups whose rows it schedules whole (a live group's with its
        members' private blocks; the workers hold a live group's beams from
        its first on: ``started``). Members it runs outside a group step
        are named in ``output`` (their samples are taken back)."""
        stepping_groups = [g for g in groups if g.phase is not Phase.FORK]
        before = {g.root_id: set(g.outside) for g in stepping_groups}
        requests = self.core.scheduler.requests
        steps: list[GroupStep] = []
        scheduled = output.num_scheduled_tokens
        for group in stepping(stepping_groups, scheduled, requests):
            live_group = group.phase is Phase.LIVE
            blocks = self.private_blocks(group) if live_group else None
            steps.append(group.plan(blocks))
            group.started |= live_group
        outside = {
            rid for g in stepping_groups for rid in g.outside - before[g.root_id]
        }
        if outside:
            put_outside(output, outside)
        return steps

    # -- the output of a step ------------------------------------------------------

    def outputs_arrive(
        self, scheduler_output: SchedulerOutput, groups: Iterable[BeamGroup]
    ) -> None:
        """Samples this output's step made outside a group step: taken back
        as their outputs are read (:meth:`take_back`), no longer in flight."""
        self.outside_now = outside_of(scheduler_output)
        for group in groups:
            group.outside -= self.outside_now

    def take_back(self, out: EngineCoreOutput) -> None:
        """A live member's output: its sample is taken back if it was made
        outside a group step."""
        if out.request_id in self.outside_now and out.new_token_ids:
            self.rewind(out.request_id)

    def stalled(self, group: BeamGroup) -> list[Request]:
        """The group's members the last ``schedule()`` held while a sibling
        waits (:func:`stalled`)."""
        return stalled(self.core.scheduler.requests, group, self.sat_out)

    # -- the group's steps ---------------------------------------------------------

    def start(self, group: BeamGroup, step: Step, nodes: list[int]) -> list[Beam]:
        """The group's ``width`` members, children of the root: member ``i``
        carries first beam ``i``; the others (fewer beams than places: a
        narrow catalog prefix) carry none yet, on beam 0's tokens."""
        beams = []
        for i in range(group.config.width):
            seq, pid = step.beams[min(i, len(step.beams) - 1)]
            rid = self._groups.spawn(group, seq.tokens, pid, i, {})
            group.members.append(rid)
            if i < len(step.beams):
                beams.append(Beam(seq, rid, nodes[i] if nodes else 0))
        return beams

    def snapshot(
        self, group: BeamGroup, result: GroupResult
    ) -> dict[int, tuple[int, list[int] | None]]:
        """Read before the step's tokens are appended, for each member that
        carries a next beam: its token count, and, moved onto another beam,
        its new parent's tokens past the root's prompt."""
        requests = self.core.scheduler.requests
        start = group.prompt_len
        snapshots: dict[int, tuple[int, list[int] | None]] = {}
        for parent, carrier in zip(result.parents, result.carriers, strict=True):
            source = requests.get(group.beams[parent].request_id)
            member = requests.get(group.members[carrier])
            if source is None or member is None:
                continue  # finished with the group's last step, or aborted
            moved = member is not source
            history = self.core.upstream.history(source, start) if moved else None
            snapshots[carrier] = (member.num_tokens, history)
        return snapshots

    def apply(
        self, group: BeamGroup, step: Step, nodes: list[int], carriers: list[int]
    ) -> list[Beam]:
        """The next beams, on the members the worker put them on: a moved
        member takes its parent's history (the worker copied its KV), every
        carrier its beam's token (the worker sampled it)."""
        requests = self.core.scheduler.requests
        snapshots, group.snapshots = group.snapshots, {}
        beams = []
        pairs = zip(step.beams, carriers, strict=True)
        for i, ((seq, _), carrier) in enumerate(pairs):
            if carrier < 0:
                raise RuntimeError("a beam with no member to carry it")
            member = requests.get(group.members[carrier])
            if member is not None and carrier in snapshots:
                length, history = snapshots[carrier]
                self.core.upstream.adopt(
                    member, group.prompt_len, length, history, seq.tokens[-1]
                )
                if history is not None:  # its private blocks were copied
                    size = self.core.block_size
                    private = -(-length // size) - group.prompt_len // size
                    group.num_forks += 1
                    group.num_copied_blocks += private
                    self.num_moved += 1
            beams.append(Beam(seq, group.members[carrier], nodes[i] if nodes else 0))
        return beams

    def private_blocks(self, group: BeamGroup) -> list[list[list[int]]]:
        """Each member's blocks past the prefix all members share, up to the
        last one the step writes, per KV-cache group (the workers copy a
        parent's into the member that takes its child); none for the
        group's last step, whose beams are final: no member computes their
        KV, so nothing is copied (the worker's block copies, one gather and
        one scatter a layer on a GPU, are left out)."""
        upstream = self.core.upstream
        requests = self.core.scheduler.requests
        size = upstream.block_size
        shared = group.prompt_len // size
        # Read after the schedule: the step's position is counted.
        computed = requests[group.members[0]].num_computed_tokens
        if computed >= group.prompt_len + group.config.max_tokens - 1:
            return []
        end = -(-computed // size)
        if group.tables is not None and group.private and group.private[0] == end:
            return group.private[1]  # tables fixed: the same blocks
        tables = group.tables or [upstream.block_ids_of(r) for r in group.members]
        blocks = [[t[g][shared:end] for t in tables] for g in range(len(tables[0]))]
        lengths = {len(ids) for per_group in blocks for ids in per_group}
        assert lengths == {end - shared}, (
            f"beam group {group.root_id}: members' tables differ in length"
        )
        if group.tables is not None:
            group.private = (end, blocks)
        return blocks

    def rewind(self, request_id: str) -> None:
        """Takes back a member's sample made outside a group step: the token,
        and (running) the position that computed it, which its next group
        step computes again; the workers get the member whole."""
        request = self.core.scheduler.requests.get(request_id)
        if request is not None:
            self.core.resends.rewind(request)


def stepping(
    groups: Iterable[BeamGroup], scheduled: Mapping[str, int],
    requests: Mapping[str, Request],
) -> list[BeamGroup]:  # fmt: skip
    """The root and live groups whose step a scheduler output runs whole
    (every beam's row samples); members that it runs outside a group step
    are added to their group's ``outside`` (their samples of this output
    are taken back when it comes: ``EngineBeamSearch.on_model_output``)."""
    whole = []
    for group in groups:
        samples = [
            rid in scheduled and not requests[rid].is_prefill_chunk
            for rid in group.sampling_ids
        ]
        if all(samples):
            whole.append(group)
        else:
            ran = zip(group.sampling_ids, samples, strict=True)
            group.outside.update(rid for rid, on in ran if on)
    return whole
