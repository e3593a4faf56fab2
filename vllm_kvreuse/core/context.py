"""What every feature receives: the scheduler and the shared services.

The :class:`Core` is built once per scheduler by the hook layer. Features
read scheduler state through ``core.scheduler`` and change it only through
upstream's own methods or the services here, so block ownership stays
where :mod:`vllm_kvreuse.core.ledger` and upstream say it is. Upstream
state no public method reaches (queues, seat limits, block tables) is read
and changed through ``core.upstream``
(:class:`vllm_kvreuse.core.upstream.scheduler.Upstream`),
whose every attribute is registered and checked per vLLM release.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import Request, RequestStatus

from vllm_kvreuse.core.holds import Holds
from vllm_kvreuse.core.internal import InternalRequests
from vllm_kvreuse.core.ledger import BlockLedger
from vllm_kvreuse.core.resend import Resends
from vllm_kvreuse.core.spec import Settings
from vllm_kvreuse.core.upstream.extra_rows import ExtraRows
from vllm_kvreuse.core.upstream.scheduler import Upstream

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler

logger = init_logger(__name__)


class Core:
    """The scheduler plus the services features share.

    - ``config``: the plugin's settings (:class:`~vllm_kvreuse.core.spec.Settings`);
    - ``ledger``: blocks held past their request's life;
    - ``internal``: requests the plugin spawns;
    - ``resends``: running requests sent whole to the workers again;
    - ``holds``: requests features hold out of upstream's scheduling, and
      the one owner of their moves out of vLLM's queues and back;
    - ``upstream``: the one seam to upstream's internal state;
    - ``extra_rows``: rows a step runs outside upstream's loop (added after
      ``schedule()``, hidden from ``update_from_output``: beam groups
      stepped as one);
    - :meth:`emit`: outputs the engine itself finishes requests with
      (rejections, errors, beam results), delivered with the next step's;
    - :meth:`fail`, :meth:`abort`: finish requests at the next safe point
      (hooks run inside upstream methods, where finishing a request would
      re-enter them); :meth:`settle` runs them, the layer calls it between
      steps.
    """

    def __init__(self, scheduler: Scheduler, config: Settings) -> None:
        self.scheduler = scheduler
        self.config = config
        self.upstream = Upstream(scheduler)
        self.extra_rows = ExtraRows(scheduler)
        self.ledger = BlockLedger(self.upstream)
        self.internal = InternalRequests(scheduler.add_upstream)
        self.resends = Resends(self.upstream)
        self.holds = Holds(self.upstream)
        self._emitted: list[tuple[int, EngineCoreOutput]] = []
        self._failed: dict[str, str] = {}
        self.client_salts: dict[str, str | None] = {}
        """The cache_salt each live client request arrived with. A feature
        may rehash a request under a salt of its own (the chunk cache does);
        tenant checks compare the client's (set before ``on_add``, dropped
        after ``on_finish``)."""
        self._aborts: set[str] = set()

    @property
    def block_size(self) -> int:
        return self.scheduler.block_size

    def has_work(self) -> bool:
        """Outputs or failures still to deliver, or a release to publish."""
        return bool(
            self._emitted
            or self._failed
            or self._aborts
            or self.ledger.released_since_step
        )

    def emit(self, client_index: int, output: EngineCoreOutput) -> None:
        self._emitted.append((client_index, output))

    def flush(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        """Appends the emitted outputs to this step's ``outputs``."""
        for client_index, output in self._emitted:
            outputs.setdefault(client_index, EngineCoreOutputs()).outputs.append(output)
        self._emitted.clear()

    def finish(
        self,
        requests: Iterable[Request],
        finish_reason: FinishReason,
        stop_reason: str | None = None,
    ) -> None:
        """Finishes ``requests`` from inside the engine and tells their clients.

        Call only at a safe point (``before_schedule``, ``filter_outputs``,
        or through :meth:`settle`), never from a hook inside
        ``finish_requests`` or ``_free_request``.
        """
        requests = [r for r in requests if not r.is_finished()]
        if not requests:
            return
        status = {
            FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
            FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
        }[finish_reason]
        self.scheduler.finish_requests([r.request_id for r in requests], status)
        for request in requests:
            if request.request_id in self.internal:
                continue
            self.emit(
                request.client_index,
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=finish_reason,
                    stop_reason=stop_reason,
                    events=request.take_events(),
                    trace_headers=request.trace_headers,
                ),
            )

    def fail(self, request_id: str, why: str) -> None:
        """Finishes one request with ``FinishReason.ERROR`` at the next safe
        point (start of a step or end of one); the server carries on."""
        if request_id not in self._failed:
            logger.error("vllm-kvreuse: request %s failed: %s", request_id, why)
        self._failed[request_id] = why

    def abort(self, request_ids: Iterable[str]) -> None:
        """Aborts requests (internal ones: nobody is told) at the next safe point."""
        self._aborts.update(request_ids)

    def settle(self) -> None:
        """Runs queued failures and aborts; the layer calls it between steps."""
        if self._aborts:
            aborts, self._aborts = self._aborts, set()
            self.scheduler.finish_requests(aborts, RequestStatus.FINISHED_ABORTED)
        if self._failed:
            requests = self.scheduler.requests
            failed = [requests[r] for r in self._failed if r in requests]
            self._failed.clear()
            self.finish(failed, FinishReason.ERROR, stop_reason="kvreuse_error")

    def waiting_summary(self) -> dict[str, Any]:
        return {
            "free_blocks": self.upstream.num_free_blocks(),
            "held_blocks": self.ledger.num_blocks(),
            "internal_requests": len(self.internal.owners),
            "held": self.holds.summary(),
        }
