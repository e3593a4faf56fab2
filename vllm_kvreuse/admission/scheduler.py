"""Scheduler mixin that turns back requests whose KV-cache hit rate is too low.

Mixed in front of whichever scheduler class vLLM picked (``Scheduler``,
``AsyncScheduler`` or a user's subclass) by :mod:`vllm_kvreuse.scheduler`.

When: at the start of ``schedule()``, for each waiting request the scheduler
has not yet judged in its current life (new, or back from a preemption),
before upstream's loop allocates any block for it. Upstream's loop then never
sees a rejected request.

Block ownership: the check only looks up the prefix cache; it takes no
reference on any block, so a rejected request owns nothing and a passed one is
handled by upstream exactly as without the plugin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import Request, RequestStatus

from vllm_kvreuse.admission.policy import FINISH_REASON, decide, effective_threshold
from vllm_kvreuse.config import KVReuseConfig

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ModelRunnerOutput

logger = init_logger(__name__)

_JUDGED_STATUSES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class CacheHitThresholdMixin(Scheduler):
    """Rejects waiting requests whose hit rate is below their threshold.

    State:
    - ``_due`` holds the waiting requests not yet judged in their current
      life: a request enters on arrival (``add_request``) and again when it is
      preempted (``_preempt_request``), and leaves once judged or freed. So a
      step looks only at new arrivals, not at the whole waiting queue.
    - ``_rejected`` holds outputs for requests finished by ``schedule()``;
      the next ``update_from_output()`` hands them to the frontend (vLLM
      calls it after every ``schedule()``, also with the batch queue).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = KVReuseConfig.from_vllm_config(self.vllm_config)
        self.global_cache_hit_threshold = config.global_cache_hit_threshold
        self._due: dict[str, Request] = {}
        self._rejected: list[EngineCoreOutput] = []
        self._rejected_clients: list[int] = []
        self.num_cache_threshold_rejections = 0

    # -- hooks into upstream -------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        self._judge_due_requests()
        return super().schedule(*args, **kwargs)

    def add_request(self, request: Request) -> None:
        # An id already known is a streaming-input update, not a new request.
        is_new = request.request_id not in self.requests
        super().add_request(request)
        if is_new:
            self._due[request.request_id] = request

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super()._preempt_request(request, *args, **kwargs)
        self._due[request.request_id] = request

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for client_index, output in zip(
            self._rejected_clients, self._rejected, strict=True
        ):
            outputs.setdefault(client_index, EngineCoreOutputs()).outputs.append(output)
        self._rejected.clear()
        self._rejected_clients.clear()
        return outputs

    def has_requests(self) -> bool:
        # Keep the engine stepping until rejections have been reported.
        return bool(self._rejected) or super().has_requests()

    def _free_request(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        self._due.pop(request.request_id, None)
        return super()._free_request(request, *args, **kwargs)

    # -- the check ----------------------------------------------------------

    def num_cache_hit_tokens(self, request: Request) -> int | None:
        """Tokens of ``request`` whose KV it would not compute, or None if unknown.

        Sums every hit source: the local prefix cache and what a KV connector
        reports as loadable. None while the connector cannot tell yet (the
        request is judged again next step). Features that hand a request KV
        by other means (continuation, chunk cache) add their tokens here.

        Pure lookup: no block is referenced or allocated.
        """
        _, num_local, *_ = self._get_local_prefix_cache_hit(request)
        if self.connector is None:
            return num_local
        # As upstream does: the connector sees the block-aligned local hit and
        # may supersede its partial tail.
        aligned_local = num_local - num_local % self.block_size
        num_external, _ = self.connector.get_num_new_matched_tokens(
            request, aligned_local
        )
        if num_external is None:
            return None
        return min(max(num_local, aligned_local + num_external), request.num_tokens)

    def _judge_due_requests(self) -> None:
        """Finishes every due request whose hit rate is below its threshold."""
        if self._pause_state != PauseState.UNPAUSED or not self._due:
            return
        rejected = []
        for request in list(self._due.values()):
            verdict = self._judge(request)
            if verdict is not None:
                del self._due[request.request_id]
            if verdict:
                rejected.append(request)
        if rejected:
            self.finish_requests(
                [request.request_id for request in rejected],
                RequestStatus.FINISHED_ABORTED,
            )
        for request in rejected:
            self._rejected_clients.append(request.client_index)
            self._rejected.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=FinishReason.ABORT,
                    stop_reason=FINISH_REASON,
                    events=request.take_events(),
                    trace_headers=request.trace_headers,
                )
            )
        self.num_cache_threshold_rejections += len(rejected)

    def _judge(self, request: Request) -> bool | None:
        """True to reject, False to admit, None to judge again next step."""
        if request.status not in _JUDGED_STATUSES or request.num_computed_tokens:
            return False  # upstream has already taken it on
        if request.num_stale_output_tokens:
            return None  # in-flight output of a preempted request drains first
        params = request.sampling_params
        extra_args = params.extra_args if params is not None else None
        threshold = effective_threshold(extra_args, self.global_cache_hit_threshold)
        if threshold <= 0.0:
            return False
        num_hits = self.num_cache_hit_tokens(request)
        if num_hits is None:
            return None
        decision = decide(num_hits, request.num_tokens, threshold)
        if not decision.admit:
            logger.debug(
                "Rejecting request %s: cache hit rate %.3f < threshold %.3f",
                request.request_id,
                decision.hit_rate,
                decision.threshold,
            )
        return not decision.admit
