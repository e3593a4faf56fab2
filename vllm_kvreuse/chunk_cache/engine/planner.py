"""The chunk cache's scheduler side: chunked requests' plans.

A chunked request is planned on arrival (:mod:`.placement`: each chunk
loaded, loaded and partly recomputed, or computed in place and stored).
So a request whose chunks are all new is computed exactly as plain vLLM
computes its tokens, and keeps its own ``cache_salt``; every stored chunk
carries the context of the request that first brought it.

Liveness: a request never waits for another. Every chunk it loads is
stored and pinned when it is planned; everything else it computes.

Segments: a plan with loads and computed spans runs its whole prefill in
one step where it can (:mod:`.rows`: every region loaded, every computed
span a query row of that step; armed on admission or between steps). Where
it cannot (no free runner rows, a token budget too small, prompt log-probs
asked), it runs one span a step: it loads its first region on admission
(the connector's external tokens) and every later region between two steps
(:meth:`advance` moves the running request's computed count past it, and
the region's load goes out with the step that computes the span after it);
:meth:`cap` ends each step's prefill at the span's end. Either way every
computed span is a prefill with exact causality.

The store itself (keys, pins, reservations) belongs to :mod:`.store`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.v1.request import Request

from vllm_kvreuse.chunk_cache.engine.placement import place_chunks
from vllm_kvreuse.chunk_cache.engine.plan import ChunkPlan
from vllm_kvreuse.chunk_cache.engine.recompute import (
    Recompute,
    Span,
)
from vllm_kvreuse.chunk_cache.engine.rows import Arming, Rows
from vllm_kvreuse.chunk_cache.engine.said import Said
from vllm_kvreuse.chunk_cache.engine.stats import Reports
from vllm_kvreuse.chunk_cache.engine.tiers import build_store
from vllm_kvreuse.chunk_cache.messages import (
    ChunkMeta,
    ChunkWorkerReport,
    LoadSpec,
    SaveSpec,
)
from vllm_kvreuse.core.spec import settings_of
from vllm_kvreuse.core.upstream.scheduler import Upstream, block_ids

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput


class ChunkScheduler:
    """Plans chunked requests and builds each step's loads and saves."""

    def __init__(
        self, vllm_config: Any, kv_cache_config: KVCacheConfig, block_size: int
    ) -> None:
        settings = settings_of(vllm_config)
        self.block_size = block_size
        self.recompute = Recompute(
            head=settings.chunk_recompute_head,
            select=settings.chunk_recompute_select,
            tail=settings.chunk_recompute_fraction,
        )
        self.store = build_store(vllm_config, kv_cache_config, block_size, settings)
        self.plans: dict[str, ChunkPlan] = {}
        # requests computing chunks they store, until their last save
        self._computing: dict[str, Request] = {}
        # request id -> the load regions its next scheduled step loads (set
        # on admission, or by advance() between steps)
        self._loads: dict[str, list[Span]] = {}
        self.arming = Arming(vllm_config)  # one-pass steps (.rows)
        self._offered: dict[str, int] = {}  # request id -> end of the offered load
        self._kv_cache_manager: KVCacheManager | None = None
        self._reports = Reports()
        self.rolled_back: set[str] = set()
        self.said = Said(self.store.stats)  # its responses' kv_transfer_params

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._kv_cache_manager = kv_cache_manager

    # -- planning --------------------------------------------------------------

    def plan(
        self,
        request: Request,
        lengths: list[int],
        recompute: Recompute | None = None,
        exact: bool = False,
    ) -> ChunkPlan | None:
        """``request``'s plan (pins its loads, reserves what it stores), or
        None when it neither loads nor stores a chunk (it then runs as an
        ordinary request, which it is). ``exact``: it loads only chunks
        stored after the same tokens (:mod:`.placement`)."""
        settings = self.recompute if recompute is None else recompute
        plan = place_chunks(self.store, request, lengths, settings, exact)
        plan.one_pass = self.arming.allows(request)
        plan.count(self.store.stats)
        if not plan.loaded_keys and not plan.unsaved:
            return None
        self.plans[request.request_id] = plan
        if plan.unsaved:
            self._computing[request.request_id] = request
        return plan

    def release(self, request_id: str) -> ChunkPlan | None:
        """Drops ``request_id``'s plan: its pins, and the reservations of
        chunks it has not saved (a preempted request is planned again)."""
        self._loads.pop(request_id, None)
        self._offered.pop(request_id, None)
        self.arming.armed.pop(request_id, None)
        self._computing.pop(request_id, None)
        plan = self.plans.pop(request_id, None)
        if plan is not None:
            self._unpin(plan)
            for chunk in plan.unsaved:
                self.store.abandon(chunk.key, request_id)
        return plan

    def stored_tokens_past(self, request_id: str, num_local: int) -> int | None:
        """Tokens the request loads from the store past ``num_local``;
        None without a plan."""
        plan = self.plans.get(request_id)
        return None if plan is None else plan.num_loaded(begin=num_local)

    def cap(self, request: Request, num_computed: int, num_new: int) -> int:
        """How many of ``num_new`` tokens a prefill of ``request`` from
        ``num_computed`` may run: all of an armed one-pass step or none (it
        then runs one span a step from the next), else up to its span's end.
        A step armed where the request does not stand (upstream's own hit
        reached further) is dropped."""
        request_id = request.request_id
        rows = self.arming.armed.get(request_id)
        if rows is not None:
            if num_computed != rows.first_position(request.num_tokens):
                del self.arming.armed[request_id]
            elif num_new >= rows.num_tokens:
                return rows.num_tokens
            else:
                self.plans[request_id].one_pass = False
                return 0
        plan = self.plans.get(request_id)
        if plan is None or not plan.spans:
            return num_new
        stop = plan.compute_stop(num_computed)
        return num_new if stop is None else stop - num_computed

    def advance(self, request: Request) -> bool:
        """Moves a running segmented request past what its next step loads:
        to where a one-pass step starts (:mod:`.rows`), else past the load
        region it stands at. Its computed count jumps there and the regions
        are loaded in the next step that schedules it. True if it moved (its
        workers must then get its whole state again)."""
        request_id = request.request_id
        plan = self.plans.get(request_id)
        if plan is None or not plan.spans or request_id in self._loads:
            return False
        start = request.num_computed_tokens
        if not start:
            return False  # not admitted yet
        if (rows := self.arming.arm(plan, request, start, admitting=False)) is not None:
            self._loads[request_id] = rows.loads
            Upstream.move_computed(request, rows.first_position(request.num_tokens))
            return True
        stop = plan.load_stop(start)
        if stop == start:
            return False  # not in a load region
        self._loads[request_id] = [(start, stop)]
        Upstream.move_computed(request, stop)
        return True

    def disarm(self, request: Request, rows: Rows) -> None:
        """An armed step that did not run: the request stands where it did."""
        self._loads.pop(request.request_id, None)
        self._offered.pop(request.request_id, None)
        if request.num_computed_tokens == rows.first_position(request.num_tokens):
            Upstream.move_computed(request, rows.real)

    # -- vLLM's connector calls ------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        plan = self.plans.get(request.request_id)
        if plan is None or num_computed_tokens >= plan.last_load_end:
            return 0, False
        stop = plan.load_stop(num_computed_tokens)
        # Upstream loads what is offered here from num_computed_tokens on,
        # and tells update_state_after_alloc only how many.
        self._offered[request.request_id] = stop
        rows = self.arming.arm(plan, request, num_computed_tokens, admitting=True)
        if rows is not None:
            return rows.first_position(request.num_tokens) - num_computed_tokens, False
        return stop - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        stop = self._offered.pop(request.request_id, None)
        if (rows := self.arming.armed.get(request.request_id)) is not None:
            self._loads[request.request_id] = rows.loads
        elif stop is not None and num_external_tokens:
            self._loads[request.request_id] = [(stop - num_external_tokens, stop)]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ChunkMeta:
        meta = ChunkMeta()
        scheduled = scheduler_output.num_scheduled_tokens
        if self._loads:
            for request_id in [r for r in self._loads if r in scheduled]:
                regions = self._loads.pop(request_id)
                plan = self.plans[request_id]
                blocks = self._block_ids(request_id)
                pieces = [p for a, b in regions for p in plan.pieces(a, b)]
                meta.loads.append(LoadSpec(request_id, blocks, pieces))
                if regions[-1][1] >= plan.last_load_end:
                    self._unpin(plan)
            if meta.loads:  # a running request's load feeds this step's forward
                scheduler_output.has_sync_kv_loads = True
        if self._computing:
            self._add_saves(meta, scheduled)
        meta.ops = self.store.take_ops()
        return meta

    def _add_saves(self, meta: ChunkMeta, scheduled: dict[str, int]) -> None:
        """Saves of the chunks computed in place by the end of this step."""
        for request_id in [r for r in self._computing if r in scheduled]:
            request = self._computing[request_id]
            plan = self.plans[request_id]
            done = request.num_computed_tokens + scheduled[request_id]
            ready = [chunk for chunk in plan.unsaved if chunk.end <= done]
            if not ready:
                continue
            blocks = self._block_ids(request_id)
            for chunk in ready:
                save = SaveSpec(
                    chunk.key, blocks, chunk.start, chunk.length, chunk.origin
                )
                meta.saves.append(save)
                self.store.saved(chunk.key)
            plan.unsaved = [chunk for chunk in plan.unsaved if chunk.end > done]
            if not plan.unsaved:
                del self._computing[request_id]

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        """Releases the request's plan; returns what its client reads in the
        response's ``kv_transfer_params`` (the documents kept, or the cap), if any."""
        self.release(request.request_id)
        return self.said.take(request.request_id)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """What the workers report: chunks a tier lost are forgotten, and a
        request whose load failed is planned no further (vLLM recomputes it
        from the failed block on, as an ordinary request)."""
        report = output.kv_connector_worker_meta
        if isinstance(report, ChunkWorkerReport):
            self.store.lost(report.lost)
            self.store.stats.io_dropped += report.dropped
        if output.invalid_block_ids and self._kv_cache_manager is not None:
            failed = output.invalid_block_ids
            for request_id in list(self.plans):
                if failed.intersection(self._block_ids(request_id)):
                    self.release(request_id)
                    self.rolled_back.add(request_id)

    def take_rolled_back(self) -> set[str]:
        """Running requests vLLM took back to a failed load's first block:
        their workers' copy is stale (the feature resends them)."""
        rolled_back, self.rolled_back = self.rolled_back, set()
        return rolled_back

    # -- stats -----------------------------------------------------------------

    def stats_since_last_report(self) -> dict[str, int] | None:
        """Counter increments since the last report and current gauges;
        None when nothing changed."""
        return self._reports.since_last(self.store.stats, self.store.gauges())

    # -- helpers ---------------------------------------------------------------

    def _unpin(self, plan: ChunkPlan) -> None:
        if plan.pinned:
            plan.pinned = False
            self.store.let_go(plan.held)

    def _block_ids(self, request_id: str) -> list[int]:
        assert self._kv_cache_manager is not None
        return list(block_ids(self._kv_cache_manager, request_id)[0])
