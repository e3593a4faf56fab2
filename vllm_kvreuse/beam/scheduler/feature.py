"""Beam search inside the engine, beams forking their parent's KV blocks.

A beam group starts from one root request (``extra_args["kvreuse_beam"]``)
that the frontend sends instead of one request per beam per step. Each step
runs next to the logits in the worker that samples it
(:mod:`~vllm_kvreuse.beam.worker.job`): the scheduler names the step's
groups in its output (:meth:`BeamGroup.plan`), the worker returns each
group's next beams (:mod:`~vllm_kvreuse.beam.plan`). The root's prefill
gives the first step; then the group's step strategy, chosen once, runs the
rest: *live* (:mod:`.live`) where blocks can be handed over (full attention,
prefix caching): ``width`` member requests for the whole search, the workers
applying each step themselves, so a group advances every engine step under
async scheduling too; else *fork* (:mod:`.fork`): each step's beams are new
one-token requests whose log-prob rows are ranked on the host
(:mod:`.policies`).

Block ownership: live members own their blocks as any running request
(the prompt's full blocks shared, the rest their own); a fork member's
parent is held in the ledger (owner ``beam``) until the step after next is
selected, as the root is until its children have run. Under memory
pressure the oldest group's held blocks are released (its waiting members
then use the prefix cache), else the oldest group's members that sit out
for a sibling are preempted, so beams can never deadlock the queue.
``reset_prefix_cache`` releases every held beam. When the group ends,
fails or is aborted, everything it holds is released, its members are
aborted and the workers forget its beams.

Admission: a step is admitted whole (:mod:`.gate`). Outputs: the root's and
members' outputs never reach the client; the root's client gets one final
output whose ``stop_reason`` carries the best beams (:mod:`~vllm_kvreuse.beam.result`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import Request, RequestStatus

from vllm_kvreuse.beam import result as beam_result
from vllm_kvreuse.beam.catalog.load import engine_catalog
from vllm_kvreuse.beam.plan import (
    GroupResult,
    GroupStep,
    outside_of,
    put_outside,
    put_steps,
    results_of,
    steps_of,
)
from vllm_kvreuse.beam.policy import BeamConfig, best
from vllm_kvreuse.beam.scheduler import live
from vllm_kvreuse.beam.scheduler.fork import ForkSteps
from vllm_kvreuse.beam.scheduler.gate import steps_that_do_not_fit
from vllm_kvreuse.beam.scheduler.group import BeamGroup, Phase
from vllm_kvreuse.beam.scheduler.live import OWNER, LiveSteps
from vllm_kvreuse.beam.scheduler.members import Members
from vllm_kvreuse.beam.scheduler.policies import policy_for
from vllm_kvreuse.core.feature import Feature

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ModelRunnerOutput

    from vllm_kvreuse.core.context import Core

_DONE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
_OK = (FinishReason.STOP, FinishReason.LENGTH)


class EngineBeamSearch(Feature):
    """Runs beam groups; members are internal requests to upstream's loop."""

    name = "beam"

    def __init__(self, core: Core) -> None:
        super().__init__(core)
        self._groups: dict[str, BeamGroup] = {}  # by root id, oldest first
        self.members = Members(core, self)  # roots and members by id
        self.live_steps = LiveSteps(core, self.members)
        self._fork = ForkSteps(self.members)
        self._ready: dict[str, BeamGroup] = {}  # a step's result is in
        self._parked: list[Request] = []  # waiting members out of one schedule
        self._held: list[Request] = []  # running members out of one schedule
        self._sat_out: set[str] = set()  # the last schedule's held members
        self._ended: list[str] = []  # live groups the workers must forget
        self._outside_now: set[str] = set()  # this update's samples to take back
        # The SID catalog (--sid-catalog), on CPU: the scheduler walks it.
        self.catalog = engine_catalog(core.scheduler.vllm_config, "cpu")
        self._upstream = core.upstream

    # -- requests --------------------------------------------------------------

    def on_add(self, request: Request) -> None:
        sampling = request.sampling_params
        config = BeamConfig.from_extra_args(sampling.extra_args if sampling else None)
        if config is None:
            return
        group = BeamGroup.start(request, config, policy_for(config, self.catalog))
        self._groups[request.request_id] = group
        self.members.add(request.request_id, group)

    def before_free_blocks(self, request: Request) -> None:
        """A root's or fork member's blocks stay for the next step's beams
        (a live member ends with its group: nobody forks from it)."""
        group = self.members.get(request.request_id)
        if group is None or request.status not in _DONE:
            return
        if request.request_id == group.root_id or group.phase is Phase.FORK:
            self.core.ledger.hold(request, OWNER)

    def on_finish(self, request: Request) -> None:
        """A root or member that ends otherwise than by its one step ends its
        group; the root's client is told unless it went away or was already
        answered (a rejection)."""
        group = self.members.get(request.request_id)
        if group is None or request.status in _DONE:
            return
        is_root = request.request_id == group.root_id
        self._drop(group)
        if not is_root and request.status != RequestStatus.FINISHED_ABORTED:
            self._emit(group, FinishReason.ERROR, None)

    def on_abort(self, request_ids: set[str]) -> None:
        """A client abort of a root whose first step is over ends its group."""
        for root_id in request_ids & self._groups.keys():
            if root_id not in self.core.scheduler.requests:
                self._drop(self._groups[root_id])

    def cap_new_tokens(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        group = self.members.get(request.request_id)
        if group is None or group.phase is not Phase.LIVE:
            return num_new_tokens
        return live.cap(request, num_computed_tokens, num_new_tokens)

    # -- steps -----------------------------------------------------------------

    def before_schedule(self) -> None:
        if not self._groups:
            return
        upstream = self._upstream
        self._parked = steps_that_do_not_fit(
            upstream, self._groups, self.members.group_of
        )
        upstream.park(self._parked)
        groups = (g for g in self._groups.values() if g.phase is Phase.LIVE)
        self._held = live.to_hold(upstream, groups)
        upstream.hold(self._held)

    def after_schedule(self, output: SchedulerOutput) -> None:
        if self._parked:  # back at the head, in their order
            self._upstream.unpark(self._parked)
            self._parked = []
        self._sat_out = {r.request_id for r in self._held}
        if self._held:
            self._upstream.put_back(self._held)
            self._held = []
        steps = [GroupStep(root_id, "end", []) for root_id in self._ended]
        self._ended = []
        if self._groups:
            groups = [g for g in self._groups.values() if g.phase is not Phase.FORK]
            requests = self.core.scheduler.requests
            before = {g.root_id: set(g.outside) for g in groups}
            for group in live.stepping(groups, output.num_scheduled_tokens, requests):
                live_group = group.phase is Phase.LIVE
                blocks = self.live_steps.private_blocks(group) if live_group else None
                steps.append(group.plan(blocks))
                group.started |= live_group
            outside = {rid for g in groups for rid in g.outside - before[g.root_id]}
            if outside:
                put_outside(output, outside)
        if steps:
            put_steps(output, steps)

    def on_model_output(
        self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput
    ) -> None:
        """The workers' results of the step's groups
        (:mod:`~vllm_kvreuse.beam.plan`)."""
        # Samples this output's step made outside a group step: taken back
        # as their outputs are read (_take), and no longer in flight.
        self._outside_now = outside_of(scheduler_output)
        for group in self._groups.values():
            group.outside -= self._outside_now
        results = results_of(model_output)
        for step in steps_of(scheduler_output):
            group = self._groups.get(step.group_id)
            if group is None or step.kind == "end":
                continue  # dropped meanwhile
            packed = results.get(step.group_id)
            if packed is None:
                self._drop(group)
                self.core.fail(
                    group.root_id,
                    "the model runner returned no beam step (is this runner's "
                    "sampler patched? see docs/engine_beam_search.md)",
                )
                continue
            group.result = GroupResult.unpack(packed, len(group.beams))
            group.delivered.clear()
            if group.phase is Phase.LIVE:  # the workers have applied it
                group.snapshots = self.live_steps.snapshot(group, group.result)
                self._ready[group.root_id] = group

    def on_internal_output(self, output: EngineCoreOutput) -> None:
        self._take(output)

    def filter_outputs(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        if self._groups:
            for engine_outputs in outputs.values():
                engine_outputs.outputs = [
                    out
                    for out in engine_outputs.outputs
                    if out.request_id not in self._groups or not self._take(out)
                ]
        for group in self._groups.values():
            if group.result is not None and group.phase is Phase.ROOT:
                self._settle(group)
        ready, self._ready = self._ready, {}
        for group in ready.values():
            try:
                self._advance(group)
            except Exception as e:  # one group's failure is that group's
                self._drop(group)
                self.core.fail(group.root_id, f"beam step failed: {e}")

    def _settle(self, group: BeamGroup) -> None:
        """A root's step counts once its sample came; else (a preemption
        dropped it: the root samples again) it is discarded. (A live
        group's step counts as the workers ran it: they applied it.)"""
        if group.root_id in group.delivered:
            self._ready[group.root_id] = group
        else:
            group.result = None

    def release_under_pressure(self) -> bool:
        """Held beams may be what blocks the queue's head: let the oldest
        group's go. Its waiting members then use the prefix cache (correct,
        slower) instead of waiting forever. Else live members whose sibling
        waits (for blocks or a seat they may hold) are preempted: the
        oldest such group's (they recompute their beam later)."""
        ledger = self.core.ledger
        for group in self._groups.values():
            if any(beam_id in ledger for beam_id in group.beam_ids):
                self._release_held(group.beam_ids)
                return True
        requests = self.core.scheduler.requests
        for group in self._groups.values():
            stuck = live.stalled(requests, group, self._sat_out)
            if group.phase is Phase.LIVE and stuck:
                self._upstream.preempt(stuck)
                return True
        return False

    def reset_cache(self) -> None:
        for group in self._groups.values():
            self._release_held(group.beam_ids)

    def waiting_summary(self) -> dict[str, int]:
        return {
            "groups": len(self._groups),
            "parked_members": len(self._parked),
            "held_beam_blocks": self.core.ledger.num_blocks(OWNER),
        }

    # -- group steps -----------------------------------------------------------

    def _take(self, out: EngineCoreOutput) -> bool:
        """Consumes a root's or member's output; True if it must not reach
        the client."""
        group = self.members.get(out.request_id)
        if group is None:
            return False
        if out.request_id != group.root_id:
            stats = out.prefill_stats  # a live step computes one token
            computed = stats.num_computed_tokens if stats is not None else 1
            group.num_member_computed_tokens += computed
        if out.finish_reason is None:  # a live member's step
            if out.request_id in self._outside_now and out.new_token_ids:
                self.live_steps.rewind(out.request_id)
            return True
        self.members.forget([out.request_id])
        is_root = out.request_id == group.root_id
        # A live member ends with its group's last step (its max_tokens).
        last = group.result is not None and group.step + 1 >= group.config.max_tokens
        failed = out.finish_reason not in _OK or (
            group.phase is Phase.LIVE and not last
        )
        if not failed and group.phase is Phase.FORK:
            failed = out.new_logprobs is None
        if failed:  # a live member never finishes on its own
            self._drop(group)
            if is_root:
                return False  # the engine's own answer: pass it on
            reason = (
                out.finish_reason
                if out.finish_reason not in _OK
                else (FinishReason.ERROR)
            )
            self._emit(group, reason, None, stop_reason=out.stop_reason)
            return True
        if is_root:
            group.prefill_stats = out.prefill_stats
            group.kv_transfer_params = out.kv_transfer_params  # a connector's
            group.delivered.add(out.request_id)
        elif group.phase is Phase.FORK and self._fork.record(group, out):
            self._ready[group.root_id] = group
        return True

    def _advance(self, group: BeamGroup) -> None:
        """Applies a step: spawns or moves the next beams, or ends the group."""
        if group.root_id not in self._groups:
            return  # dropped meanwhile
        config, result = group.config, group.result
        group.result = None
        if result is not None:
            step, nodes = group.policy.device_step(result, group.beams, config)
        else:
            step, nodes = self._fork.host_step(group)
        group.completed += step.completed
        group.step += 1
        # The previous step's beams have been forked from: their KV can go.
        self._release_held(group.previous)
        group.previous = group.member_ids
        if group.step >= config.max_tokens or not step.beams:
            final = best(group.completed, [seq for seq, _ in step.beams], config)
            self._emit(group, FinishReason.STOP, final)
            self._drop(group)
        elif group.phase is Phase.LIVE:
            assert result is not None, "a live group's step comes from a worker"
            group.beams = self.live_steps.apply(group, step, nodes, result.carriers)
        elif group.phase is Phase.FORK:
            group.beams = self._fork.apply(group, step, nodes)
        else:  # the root's step: the group's strategy, chosen once
            group.phase = Phase.LIVE if self._can_live(group) else Phase.FORK
            steps = self.live_steps if group.phase is Phase.LIVE else self._fork
            group.beams = steps.start(group, step, nodes)

    def _can_live(self, group: BeamGroup) -> bool:
        """Members can outlive a step: blocks can be handed over, and the
        whole width fits the running seats at once."""
        seats = self._upstream.seat_limit()
        return self.core.ledger.enabled and group.config.width <= seats

    def _emit(
        self,
        group: BeamGroup,
        finish_reason: FinishReason,
        final: list[Any] | None,
        stop_reason: int | str | None = None,
    ) -> None:
        """The root's one and only output to its client: with ``final``
        beams, their result in the stop reason; else the engine's answer."""
        if final is not None:
            stop_reason = beam_result.encode(group.result_of(final))
        self.core.emit(
            group.root.client_index,
            EngineCoreOutput(
                request_id=group.root_id,
                new_token_ids=[],
                finish_reason=finish_reason,
                stop_reason=stop_reason,
                kv_transfer_params=group.kv_transfer_params,
                prefill_stats=group.prefill_stats,
            ),
        )

    def _drop(self, group: BeamGroup) -> None:
        """Forgets ``group``: aborts its live members, releases what it holds."""
        if self._groups.pop(group.root_id, None) is None:
            return
        self._ready.pop(group.root_id, None)
        members = self.members.of(group)
        self.members.forget(members)
        if group.started:  # the workers forget its beams
            self._ended.append(group.root_id)
        self._release_held(group.beam_ids)
        self.core.abort(r for r in members if r != group.root_id)

    def _release_held(self, request_ids: list[str]) -> None:
        self.core.ledger.release(request_ids)
