"""The scheduler hook layer: one class between vLLM's scheduler and the features.

vLLM picks ``Scheduler`` or ``AsyncScheduler`` (or a user's, or a platform's
subclass) in ``SchedulerConfig.get_scheduler_cls``; when a feature is
switched on, the registered patch (:mod:`vllm_kvreuse.scheduler`) passes that
choice through :func:`compose`, which puts :class:`KVReuseLayer` in front of
it. The layer reads the plugin's settings off the ``VllmConfig``, which
carries them parsed (:func:`~vllm_kvreuse.core.spec.settings_of`; core
imports no settings table).

:class:`KVReuseLayer` overrides each upstream method it needs exactly once
and calls the features' hooks (:mod:`vllm_kvreuse.core.feature`) in
:data:`~vllm_kvreuse.features.SPECS` order. Upstream's scheduling
loop runs unchanged inside ``super()``.

Requests a feature holds (``core.holds``, :mod:`vllm_kvreuse.core.holds`)
leave vLLM's queues right before upstream's ``schedule()``, after every
feature's ``before_schedule``, and come back as soon as it returns.

Liveness and containment:
- a per-request hook that raises fails that request alone
  (``FinishReason.ERROR``); the engine keeps serving everyone else;
- a step that preempted, or scheduled nothing while requests waited, is
  memory pressure: every feature releases the oldest thing it holds, so held
  blocks can never starve the queue for good;
- when requests wait and nothing was scheduled, the layer logs what they
  wait for (rate-limited), so a stall explains itself.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from vllm_kvreuse.core.context import Core
from vllm_kvreuse.core.feature import HOOKS, Feature, implements
from vllm_kvreuse.core.features import build_features
from vllm_kvreuse.core.ledger import Hit
from vllm_kvreuse.core.spec import settings_of

logger = init_logger(__name__)

STALL_LOG_INTERVAL = 10.0  # seconds between "waiting for" lines


class KVReuseLayer(Scheduler):
    """Overrides upstream ``Scheduler`` methods once each; features do the rest."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kvreuse = Core(self, settings_of(self.vllm_config))
        self.features: list[Feature] = build_features(self.kvreuse)
        self._hooks: dict[str, list[Feature]] = {
            hook: [f for f in self.features if implements(f, hook)] for hook in HOOKS
        }
        self._last_stall_log = 0.0

    def add_upstream(self, request: Request) -> None:
        """Queues ``request`` with upstream alone (internal requests)."""
        super().add_request(request)

    def feature(self, name: str) -> Feature | None:
        """The enabled feature called ``name`` (engine-core utilities use it)."""
        return next((f for f in self.features if f.name == name), None)

    # -- requests --------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id not in self.requests:  # else a streaming update
            self.kvreuse.client_salts[request.request_id] = request.cache_salt
            self._each_for(request, "on_add")
        super().add_request(request)
        self.kvreuse.settle()

    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> list[Request]:
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        elif request_ids is not None:
            request_ids = set(request_ids)
        if self._hooks["on_abort"]:
            ids = set(self.requests if request_ids is None else request_ids)
            for feature in self._hooks["on_abort"]:
                self._guarded(feature.on_abort, ids)
        finished = super().finish_requests(request_ids, finished_status)
        self.kvreuse.settle()
        return finished

    def _free_request(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        self._each_for(request, "on_finish")
        self.kvreuse.client_salts.pop(request.request_id, None)
        self.kvreuse.internal.retire(request.request_id)
        self.kvreuse.resends.forget(request.request_id)
        self.kvreuse.holds.forget(request.request_id)
        return super()._free_request(request, *args, **kwargs)

    def _free_blocks(self, request: Request) -> None:
        self._each_for(request, "before_free_blocks")
        super()._free_blocks(request)

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super()._preempt_request(request, *args, **kwargs)
        self._each_for(request, "on_preempt")

    def _get_local_prefix_cache_hit(self, request: Request) -> Hit:
        ledger = self.kvreuse.ledger
        if ledger and (inherited := ledger.inherited_hit(request)) is not None:
            return inherited
        hit = super()._get_local_prefix_cache_hit(request)
        if ledger:
            return ledger.extend_into_tail(request, hit) or hit
        return hit

    def _reserve_prefill_lookahead(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        """Upstream's last per-request cap on a step's new tokens, on both
        the running and the waiting path: features may split a prefill
        further (the chunk cache ends a step at a recomputed span's end)."""
        num_new_tokens = super()._reserve_prefill_lookahead(
            request, num_computed_tokens, num_new_tokens
        )
        for feature in self._hooks["cap_new_tokens"]:
            try:
                capped = feature.cap_new_tokens(
                    request, num_computed_tokens, num_new_tokens
                )
            except Exception as e:
                logger.exception("vllm-kvreuse: %s.cap_new_tokens raised", feature.name)
                self.kvreuse.fail(request.request_id, f"{feature.name}: {e}")
                continue
            num_new_tokens = max(0, min(num_new_tokens, capped))
        return num_new_tokens

    def num_cache_hit_tokens(self, request: Request) -> int | None:
        """Tokens of ``request`` whose KV it would not compute; None while a
        KV connector cannot tell yet. Pure lookup: nothing is referenced.

        Sums every source: the local prefix cache (with inherited blocks),
        then what a feature supplies (the chunk cache) or else what a KV
        connector reports as loadable.
        """
        _, num_local, *_ = self._get_local_prefix_cache_hit(request)
        for feature in self._hooks["extra_hit_tokens"]:
            extra = feature.extra_hit_tokens(request, num_local)
            if extra is not None:
                return min(num_local + extra, request.num_tokens)
        if self.connector is None:
            return num_local
        # As upstream does: the connector sees the block-aligned local hit and
        # may supersede its partial tail.
        aligned = num_local - num_local % self.block_size
        num_external, _ = self.connector.get_num_new_matched_tokens(request, aligned)
        if num_external is None:
            return None
        return min(max(num_local, aligned + num_external), request.num_tokens)

    # -- steps -----------------------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        core = self.kvreuse
        core.settle()
        core.internal.drop_retired()
        core.ledger.released_since_step = False
        self._each("before_schedule")
        core.holds.take_out()
        core.extra_rows.begin()
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            core.holds.put_back()
            core.extra_rows.return_tokens()
        core.resends.deliver(output)
        self._each("after_schedule", output)
        if self._under_pressure(output):
            self._each("release_under_pressure")
            self._log_stall(output)
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        self._each("on_model_output", scheduler_output, model_runner_output)
        # Extra rows (beam members stepped as one) are the features' to apply.
        walked = self.kvreuse.extra_rows.hidden(scheduler_output)
        outputs = super().update_from_output(walked, model_runner_output)
        core = self.kvreuse
        core.internal.route(outputs)
        self._each("filter_outputs", outputs)
        core.settle()
        core.flush(outputs)
        return outputs

    def has_requests(self) -> bool:
        return super().has_requests() or self.kvreuse.has_work()

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, *args: Any, **kwargs: Any
    ) -> bool:
        self._each("reset_cache")
        return super().reset_prefix_cache(reset_running_requests, *args, **kwargs)

    # -- plumbing --------------------------------------------------------------

    def _each(self, hook: str, *args: Any) -> None:
        """Calls ``hook`` on every feature implementing it; a raise is logged
        and contained (the feature must fail the request it concerns)."""
        for feature in self._hooks[hook]:
            self._guarded(getattr(feature, hook), *args)

    def _each_for(self, request: Request, hook: str) -> None:
        """A per-request hook: a raise fails ``request`` alone."""
        for feature in self._hooks[hook]:
            try:
                getattr(feature, hook)(request)
            except Exception as e:
                logger.exception("vllm-kvreuse: %s.%s raised", feature.name, hook)
                self.kvreuse.fail(request.request_id, f"{feature.name}: {e}")

    @staticmethod
    def _guarded(call: Callable[..., Any], *args: Any) -> None:
        try:
            call(*args)
        except Exception:
            logger.exception("vllm-kvreuse: %s raised; the step goes on", call)

    def _under_pressure(self, output: SchedulerOutput) -> bool:
        """The step preempted, or admitted nothing while requests wait."""
        stalled = not output.num_scheduled_tokens and bool(
            self.kvreuse.upstream.num_waiting()
        )
        return bool(output.preempted_req_ids) or stalled

    def _log_stall(self, output: SchedulerOutput) -> None:
        now = time.monotonic()
        if output.num_scheduled_tokens or now - self._last_stall_log < (
            STALL_LOG_INTERVAL
        ):
            return
        self._last_stall_log = now
        summary = self.kvreuse.waiting_summary()
        for feature in self._hooks["waiting_summary"]:
            summary[feature.name] = feature.waiting_summary()
        logger.info(
            "vllm-kvreuse: nothing scheduled with %d waiting; waiting for: %s",
            self.kvreuse.upstream.num_waiting(),
            summary,
        )


@functools.cache
def compose(base: type) -> type:
    """``base`` with :class:`KVReuseLayer` in front (cached per base)."""
    if issubclass(base, KVReuseLayer):
        return base
    if not issubclass(base, Scheduler):
        logger.warning(
            "vllm-kvreuse: scheduler class %s does not derive from vLLM's "
            "Scheduler; the plugin's scheduler features are off.",
            base.__qualname__,
        )
        return base
    return type(
        f"KVReuse{base.__name__}",
        (KVReuseLayer, base),
        {
            "__module__": __name__,
            "__doc__": f"{base.__qualname__} with vllm-kvreuse.",
        },
    )
