"""The chunk cache's scheduler side: chunked requests' plans.

A chunked request is planned on arrival, chunk by chunk, front to back:

- a chunk the store holds *as computed after the same tokens* (its origin
  is the one computing it here would give, :mod:`.keys`) is loaded: exactly
  what full attention computes, so nothing of it is recomputed;
- a chunk the store holds as computed elsewhere is loaded and moved there
  by RoPE; its recomputed tokens (:mod:`.recompute`: heads, chunks chosen by
  the question, a tail) are computed in the request;
- a chunk the store does not hold is **computed in place**, attending
  causally to everything before it, and stored from the request's own
  blocks in the step that finishes it, under the origin it was computed
  with (unless another request is computing it now, or the store is full of
  pinned chunks: then it is only computed).

So a request whose chunks are all new is computed exactly as plain vLLM
computes its tokens, and keeps its own ``cache_salt``; every stored chunk
carries the context of the request that first brought it.

Liveness: a request never waits for another. Every chunk it loads is
stored and pinned when it is planned; everything else it computes.

Segments: a plan with loads and computed spans loads its first region on
admission (the connector's external tokens) and every later region between
two steps (:meth:`advance` moves the running request's computed count past
it, and the region's load goes out with the step that computes the span
after it). :meth:`compute_stop` caps each step's prefill at the span's end,
so every computed span is a contiguous prefill with exact causality.

The store itself (keys, pins, reservations) belongs to :mod:`.store`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.v1.request import Request

from vllm_kvreuse.chunk_cache.engine.index import Entry
from vllm_kvreuse.chunk_cache.engine.keys import Provenance
from vllm_kvreuse.chunk_cache.engine.plan import (
    ChunkMeta,
    ChunkPlan,
    ChunkWorkerReport,
    LoadSpec,
    PlannedChunk,
    SaveSpec,
)
from vllm_kvreuse.chunk_cache.engine.recompute import (
    Recompute,
    Span,
    choose_spans,
    clip,
    merge,
)
from vllm_kvreuse.chunk_cache.engine.stats import Reports
from vllm_kvreuse.chunk_cache.engine.tiers import build_store
from vllm_kvreuse.core.spec import settings_of
from vllm_kvreuse.core.upstream.scheduler import Upstream, block_ids

DOCUMENTS_KEPT = "kvreuse_documents_kept"
"""The response's ``kv_transfer_params`` key: how many documents a request
in ``paths`` or ``choose`` mode was answered on."""
PATHS_CAPPED = "kvreuse_paths_capped"
"""Its key for a ``paths`` or ``choose`` request run ``joint``, unscored, for
having more documents than the value (``--chunk-paths-max-documents``)."""

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
        # request id -> the load region [start, stop) its next scheduled step
        # loads (set on admission, or by advance() between steps)
        self._loads: dict[str, tuple[int, int]] = {}
        self._offered: dict[str, int] = {}  # request id -> end of the offered load
        self._kv_cache_manager: KVCacheManager | None = None
        self._reports = Reports()
        self.rolled_back: set[str] = set()
        self._said: dict[str, dict[str, Any]] = {}  # id -> kv_transfer_params

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._kv_cache_manager = kv_cache_manager

    # -- planning --------------------------------------------------------------

    def plan(
        self, request: Request, lengths: list[int], recompute: Recompute | None = None
    ) -> ChunkPlan | None:
        """``request``'s plan (pins its loads, reserves what it stores), or
        None when it neither loads nor stores a chunk (it then runs as an
        ordinary request, which it is)."""
        prompt = request.prompt_token_ids or []
        settings = self.recompute if recompute is None else recompute
        rules = choose_spans(prompt, lengths, settings)
        provenance = Provenance(request.cache_salt, self.store.identity)
        lora = getattr(request.lora_request, "lora_name", "")
        chunks: list[PlannedChunk] = []
        spans: list[Span] = []
        held: list[tuple[bytes, Entry]] = []
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        keys = [
            self.store.key(request.cache_salt, lora, prompt[a : a + n])
            for a, n in zip(starts, lengths, strict=True)
        ]
        self.store.lookup_shared(keys)
        for key, start, length in zip(keys, starts, lengths, strict=True):
            tokens = prompt[start : start + length]
            chunk, chunk_spans = self._place(
                key, start, length, provenance, rules, request.request_id, held
            )
            chunks.append(chunk)
            spans += chunk_spans
            provenance.feed(tokens)
        plan = ChunkPlan(
            chunks,
            user_salt=request.cache_salt,
            block_salt=provenance.block_salt(),
            # Touching spans are one prefill: new chunks side by side are
            # computed in one step, as plain vLLM computes them (the same
            # kernels and shapes, so the same rounding on any device).
            spans=merge(spans),
            unsaved=[chunk for chunk in chunks if chunk.saves],
            held=held,
        )
        plan.count(self.store.stats)
        if not plan.loaded_keys and not plan.unsaved:
            return None
        self.plans[request.request_id] = plan
        if plan.unsaved:
            self._computing[request.request_id] = request
        return plan

    def _place(
        self,
        key: bytes,
        start: int,
        length: int,
        provenance: Provenance,
        rules: list[Span],
        owner: str,
        held: list[tuple[bytes, Entry]],
    ) -> tuple[PlannedChunk, list[Span]]:
        """One chunk's part of the plan, and the positions of it computed. A
        chunk it loads is pinned at once (added to ``held``): no later
        chunk's reservation may evict it."""
        whole = (start, start + length)
        origin = provenance.origin(key)
        entry = self.store.hold(key)
        if entry is None and not self.store.is_known(key):
            self.store.note_miss(key)
        if entry is not None:
            held.append((key, entry))
            loaded = PlannedChunk(
                key, start, length, stored_start=entry.start, origin=entry.origin
            )
            if entry.origin == origin:
                self.store.stats.exact_hits += 1
                return loaded, []
            recomputed = clip(rules, [whole])
            provenance.loaded_approximately(start, length, entry.origin, recomputed)
            return loaded, recomputed
        saves = not self.store.is_known(key) and self.store.reserve(
            key, length, start, origin, owner
        )
        chunk = PlannedChunk(key, start, length, saves=saves, origin=origin)
        return chunk, [whole]

    def release(self, request_id: str) -> ChunkPlan | None:
        """Drops ``request_id``'s plan: its pins, and the reservations of
        chunks it has not saved (a preempted request is planned again)."""
        self._loads.pop(request_id, None)
        self._offered.pop(request_id, None)
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

    def compute_stop(self, request_id: str, num_computed: int) -> int | None:
        """Where a prefill of ``request_id`` from ``num_computed`` must stop
        (the end of its computed span); None: no limit."""
        plan = self.plans.get(request_id)
        if plan is None or not plan.spans:
            return None
        return plan.compute_stop(num_computed)

    def advance(self, request: Request) -> bool:
        """Moves a running segmented request past the load region it stands
        at: its computed count jumps to the region's end and the region is
        loaded in the next step that schedules it. True if it moved (its
        workers must then get its whole state again)."""
        plan = self.plans.get(request.request_id)
        if plan is None or not plan.spans or request.request_id in self._loads:
            return False
        start = request.num_computed_tokens
        stop = plan.load_stop(start)
        if stop == start or not start:
            return False  # not in a load region, or not admitted yet
        self._loads[request.request_id] = (start, stop)
        Upstream.move_computed(request, stop)
        return True

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
        return stop - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        stop = self._offered.pop(request.request_id, None)
        if stop is not None and num_external_tokens:
            self._loads[request.request_id] = (stop - num_external_tokens, stop)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ChunkMeta:
        meta = ChunkMeta()
        scheduled = scheduler_output.num_scheduled_tokens
        if self._loads:
            for request_id in [r for r in self._loads if r in scheduled]:
                start, stop = self._loads.pop(request_id)
                plan = self.plans[request_id]
                blocks = self._block_ids(request_id)
                pieces = plan.pieces(start, stop)
                meta.loads.append(LoadSpec(request_id, blocks, pieces))
                if stop >= plan.last_load_end:
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
        return self._said.pop(request.request_id, None)

    def note_decided(self, request_id: str, kept: int) -> None:
        """Answer paths decided ``request_id`` on ``kept`` documents."""
        self.store.stats.decided += 1
        self.store.stats.documents_kept += kept
        self._said[request_id] = {DOCUMENTS_KEPT: kept}

    def note_capped(self, request_id: str, cap: int) -> None:
        """``request_id`` has more than ``cap`` documents: it runs joint."""
        self.store.stats.paths_capped += 1
        self._said[request_id] = {PATHS_CAPPED: cap}

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
