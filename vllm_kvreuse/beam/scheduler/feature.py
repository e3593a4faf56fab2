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
(:mod:`.group_rule`).

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

Who owns what: the group table (:mod:`.groups`) every group's membership
and lifecycle, with the one :meth:`~.groups.GroupTable.drop`;
:class:`~.live.LiveSteps` the live-step state between hooks (members held
out of a schedule, samples to take back); :class:`~.as_one.OneRequestSteps`
the groups stepped as one (members out of upstream's loop, their steps
added whole); :class:`~.gate.Gate` decides the
members held for a schedule (the core's holds move them,
:mod:`vllm_kvreuse.core.holds`); each group (:mod:`.group`) its own step
state. A
step's readiness is read off the group (:meth:`~.group.BeamGroup.has_step`),
not kept. The feature dispatches the hooks to them.

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
    put_steps,
    results_of,
    steps_of,
)
from vllm_kvreuse.beam.rule import BeamConfig, best
from vllm_kvreuse.beam.scheduler import sit_out
from vllm_kvreuse.beam.scheduler.as_one import OneRequestSteps
from vllm_kvreuse.beam.scheduler.fork import ForkSteps
from vllm_kvreuse.beam.scheduler.gate import Gate
from vllm_kvreuse.beam.scheduler.group import BeamGroup, Phase
from vllm_kvreuse.beam.scheduler.group_rule import rule_for
from vllm_kvreuse.beam.scheduler.groups import OWNER, GroupTable
from vllm_kvreuse.beam.scheduler.live import LiveSteps
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
        self.groups = GroupTable(core, self)
        self.live_steps = LiveSteps(core, self.groups)
        self.fork_steps = ForkSteps(self.groups)
        self.as_one = OneRequestSteps(core, self.groups)
        self.gate = Gate(core)
        # The SID catalog (--sid-catalog), on CPU: the scheduler walks it.
        self.catalog = engine_catalog(core.scheduler.vllm_config, "cpu")

    # -- requests --------------------------------------------------------------

    def on_add(self, request: Request) -> None:
        sampling = request.sampling_params
        config = BeamConfig.from_extra_args(sampling.extra_args if sampling else None)
        if config is not None:
            self.groups.start(request, config, rule_for(config, self.catalog))

    def before_free_blocks(self, request: Request) -> None:
        """A root's or fork member's blocks stay for the next step's beams
        (a live member ends with its group: nobody forks from it)."""
        group = self.groups.get(request.request_id)
        if group is None or request.status not in _DONE:
            return
        if request.request_id == group.root_id or group.phase is Phase.FORK:
            self.core.ledger.hold(request, OWNER)

    def on_finish(self, request: Request) -> None:
        """A root or member that ends otherwise than by its one step ends its
        group; the root's client is told unless it went away or was already
        answered (a rejection)."""
        group = self.groups.get(request.request_id)
        if group is None or request.status in _DONE:
            return
        is_root = request.request_id == group.root_id
        self.groups.drop(group)
        if not is_root and request.status != RequestStatus.FINISHED_ABORTED:
            self._emit(group, FinishReason.ERROR, None)

    def on_preempt(self, request: Request) -> None:
        self.as_one.leave(request)

    def on_abort(self, request_ids: set[str]) -> None:
        """A client abort of a root whose first step is over ends its group."""
        for group in self.groups.roots(request_ids):
            if group.root_id not in self.core.scheduler.requests:
                self.groups.drop(group)

    def cap_new_tokens(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        group = self.groups.get(request.request_id)
        if group is None or group.phase is not Phase.LIVE:
            return num_new_tokens
        return sit_out.cap(request, num_computed_tokens, num_new_tokens)

    # -- steps -----------------------------------------------------------------

    def before_schedule(self) -> None:
        if self.groups:
            self.as_one.hold(self.groups)  # admits first: the gate sees the rest
            self.gate.hold(self.groups)
            self.live_steps.hold(g for g in self.groups.live() if not g.as_one)

    def after_schedule(self, output: SchedulerOutput) -> None:
        self.gate.unhold()
        self.live_steps.unhold()
        ended = self.groups.take_ended()
        steps = [GroupStep(root_id, "end", []) for root_id in ended]
        if self.groups:
            self.as_one.add_rows(output)
            planned = self.live_steps.plan(self.groups, output)
            self.as_one.take_started(planned)
            steps += planned
        if steps:
            put_steps(output, steps)

    def on_model_output(
        self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput
    ) -> None:
        """The workers' results of the step's groups
        (:mod:`~vllm_kvreuse.beam.plan`)."""
        self.live_steps.outputs_arrive(scheduler_output, self.groups)
        self.as_one.count_rows(scheduler_output)
        results = results_of(model_output)
        for step in steps_of(scheduler_output):
            group = self.groups.by_root(step.group_id)
            if group is None or step.kind == "end":
                continue  # dropped meanwhile
            packed = results.get(step.group_id)
            if packed is None:
                self.groups.drop(group)
                self.core.fail(
                    group.root_id,
                    "the model runner returned no beam step (is this runner's "
                    "sampler patched? see docs/engine_beam_search.md)",
                )
                continue
            group.result = GroupResult.unpack(packed, group.num_beams)
            group.delivered.clear()
            live = group.phase is Phase.LIVE  # the workers have applied it
            if live and not self.as_one.follows_lazily(group):
                group.snapshots = self.live_steps.snapshot(group, group.result)

    def on_internal_output(self, output: EngineCoreOutput) -> None:
        self._take(output)

    def filter_outputs(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        if self.groups:
            for engine_outputs in outputs.values():
                engine_outputs.outputs = [
                    out
                    for out in engine_outputs.outputs
                    if self.groups.by_root(out.request_id) is None
                    or not self._take(out)
                ]
        for group in self.groups:
            if group.phase is Phase.ROOT and group.root_id not in group.delivered:
                # A preemption dropped the root's sample: it samples again.
                group.result = None
        for group in [g for g in self.groups if g.has_step()]:
            try:
                self._advance(group)
            except Exception as e:  # one group's failure is that group's
                self.groups.drop(group)
                self.core.fail(group.root_id, f"beam step failed: {e}")

    def release_under_pressure(self) -> bool:
        """Held beams may be what blocks the queue's head: let the oldest
        group's go. Its waiting members then use the prefix cache (correct,
        slower) instead of waiting forever. Else live members whose sibling
        waits (for blocks or a seat they may hold) are preempted: the
        oldest such group's (they recompute their beam later)."""
        for group in self.groups:
            if self.groups.holds_blocks(group):
                self.groups.free_held(group.beam_ids)
                return True
        for group in self.groups.live():
            if stuck := self.live_steps.stalled(group):
                self.core.upstream.preempt(stuck)
                return True
        return False

    def reset_cache(self) -> None:
        for group in self.groups:
            self.groups.free_held(group.beam_ids)

    def waiting_summary(self) -> dict[str, int]:
        return {
            "groups": len(self.groups),
            "held_beam_blocks": self.core.ledger.num_blocks(OWNER),
        }

    # -- group steps -----------------------------------------------------------

    def _take(self, out: EngineCoreOutput) -> bool:
        """Consumes a root's or member's output; True if it must not reach
        the client."""
        group = self.groups.get(out.request_id)
        if group is None:
            return False
        if out.request_id != group.root_id:
            stats = out.prefill_stats  # a live step computes one token
            computed = stats.num_computed_tokens if stats is not None else 1
            group.num_member_computed_tokens += computed
        if out.finish_reason is None:  # a live member's step
            self.live_steps.take_back(out)
            return True
        self.groups.forget(out.request_id)
        is_root = out.request_id == group.root_id
        # A live member ends with its group's last step (its max_tokens).
        last = group.result is not None and group.step + 1 >= group.config.max_tokens
        failed = out.finish_reason not in _OK or (
            group.phase is Phase.LIVE and not last
        )
        if not failed and group.phase is Phase.FORK:
            failed = out.new_logprobs is None
        if failed:  # a live member never finishes on its own
            self.groups.drop(group)
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
        elif group.phase is Phase.FORK:
            self.fork_steps.record(group, out)
        return True

    def _advance(self, group: BeamGroup) -> None:
        """Applies a step: spawns or moves the next beams, or ends the group."""
        if not self.groups.has(group):
            return  # dropped meanwhile
        config, result = group.config, group.result
        group.result = None
        if result is not None and self.as_one.follows_lazily(group):
            # The previous step's beams have been forked from (the root's
            # held KV, after the members' first step).
            self.groups.free_held(group.previous)
            group.previous = []
            final = self.as_one.advance(group, result)
            if final is not None:
                self._emit(group, FinishReason.STOP, final)
                self.groups.drop(group)
            return
        if result is not None:
            step, nodes = group.rule.device_step(result, group.beams, config)
        else:
            step, nodes = self.fork_steps.host_step(group)
        group.completed += step.completed
        group.step += 1
        # The previous step's beams have been forked from: their KV can go.
        self.groups.free_held(group.previous)
        group.previous = group.member_ids
        if group.step >= config.max_tokens or not step.beams:
            final = best(group.completed, [seq for seq, _ in step.beams], config)
            self._emit(group, FinishReason.STOP, final)
            self.groups.drop(group)
        elif group.phase is Phase.LIVE:
            assert result is not None, "a live group's step comes from a worker"
            group.beams = self.live_steps.apply(group, step, nodes, result.carriers)
        elif group.phase is Phase.FORK:
            group.beams = self.fork_steps.apply(group, step, nodes)
        else:  # the root's step: the group's strategy, chosen once
            group.phase = Phase.LIVE if self._can_live(group) else Phase.FORK
            live_group = group.phase is Phase.LIVE
            steps = self.live_steps if live_group else self.fork_steps
            group.beams = steps.start(group, step, nodes)

    def _can_live(self, group: BeamGroup) -> bool:
        """Members can outlive a step: blocks can be handed over, and the
        whole width fits the running seats at once."""
        seats = self.core.upstream.seat_limit()
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
