"""The cache-hit threshold as a scheduler feature (RFC #24256, option A).

When: at the start of each step, for every waiting request the feature has
not yet judged in its current life (new, or back from a preemption), before
upstream's loop allocates any block for it. Upstream's loop then never sees
a rejected request: it is finished as ABORT with stop reason
``cache_threshold`` (the frontend shows ``finish_reason: "cache_threshold"``).

Block ownership: the check only looks up caches (``num_cache_hit_tokens``);
it takes no reference, so a rejected request owns nothing and an admitted
one is handled by upstream exactly as without the plugin.

State: ``_due`` holds the requests not yet judged in their current life. A
request enters on arrival (``on_add``) and on preemption (``on_preempt``),
and leaves once judged or finished. Internal requests are never judged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.engine import FinishReason
from vllm.v1.request import Request, RequestStatus

from vllm_kvreuse.admission.policy import FINISH_REASON, decide, effective_threshold
from vllm_kvreuse.core.feature import Feature

if TYPE_CHECKING:
    from vllm_kvreuse.core.context import Core

logger = init_logger(__name__)

_JUDGED_STATUSES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class CacheHitThreshold(Feature):
    """Rejects waiting requests whose hit rate is below their threshold."""

    name = "admission"

    def __init__(self, core: Core) -> None:
        super().__init__(core)
        threshold = core.config.global_cache_hit_threshold
        assert threshold is not None, "the feature is on only with a global value"
        self.global_threshold = threshold
        self._due: dict[str, Request] = {}
        self.num_rejections = 0

    def on_add(self, request: Request) -> None:
        self._due[request.request_id] = request

    def on_preempt(self, request: Request) -> None:
        if request.request_id not in self.core.internal:
            self._due[request.request_id] = request

    def on_finish(self, request: Request) -> None:
        self._due.pop(request.request_id, None)

    def before_schedule(self) -> None:
        """Finishes every due request whose hit rate is below its threshold."""
        scheduler = self.core.scheduler
        if scheduler.pause_state != PauseState.UNPAUSED or not self._due:
            return
        rejected = []
        for request in list(self._due.values()):
            verdict = self._judge(request)
            if verdict is not None:
                del self._due[request.request_id]
            if verdict:
                rejected.append(request)
        self.core.finish(rejected, FinishReason.ABORT, stop_reason=FINISH_REASON)
        self.num_rejections += len(rejected)

    def _judge(self, request: Request) -> bool | None:
        """True to reject, False to admit, None to judge again next step."""
        if request.status not in _JUDGED_STATUSES or request.num_computed_tokens:
            return False  # upstream has already taken it on
        if request.num_stale_output_tokens:
            return None  # in-flight output of a preempted request drains first
        params = request.sampling_params
        extra_args = params.extra_args if params is not None else None
        threshold = effective_threshold(extra_args, self.global_threshold)
        if threshold <= 0.0:
            return False
        num_hits = self.core.scheduler.num_cache_hit_tokens(request)
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
