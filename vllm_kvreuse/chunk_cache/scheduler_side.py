"""The chunk cache's scheduler side: the store index and every plan.

Sole owner of the :class:`~vllm_kvreuse.chunk_cache.store.ChunkIndex` (what
is stored, pinned, reserved) and of the chunked requests' plans and the
fills that compute missing chunks. The feature
(:mod:`vllm_kvreuse.chunk_cache.feature`) asks it to plan; vLLM's connector
calls (through :mod:`.connector`) ask it what to load and save.

Liveness: a chunked request is never admitted before every chunk it needs is
stored. Until then :meth:`get_num_new_matched_tokens` answers "cannot tell
yet" (None), so upstream skips it without allocating a block; once all are
stored the load is synchronous (the worker writes the chunks before the
step's forward pass). A request therefore never holds blocks while it waits
for a fill, and a fill never waits for blocks such a request holds. A fill
that ends without saving its chunk (aborted, failed) leaves its waiters
planless for that chunk: :meth:`fill_finished` returns them to be planned
again (a new fill, or the ordinary path if the store cannot take it).

Segments: a plan with recomputed spans loads its first region on admission
(the connector's external tokens) and every later region between two steps
(:meth:`advance` moves the running request's computed count past it, and the
region's load goes out with the step that computes the span after it).
:meth:`compute_stop` caps each step's prefill at the span's end, so every
computed span is a contiguous prefill with exact causality.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.v1.request import Request

from vllm_kvreuse.chunk_cache.fill_context import attention_tag, load_fill_context
from vllm_kvreuse.chunk_cache.keys import (
    chunk_key,
    chunked_salt,
    key_hasher,
    model_identity,
)
from vllm_kvreuse.chunk_cache.plan import (
    ChunkMeta,
    ChunkPlan,
    FillSpec,
    LoadSpec,
    PlannedChunk,
    SaveSpec,
)
from vllm_kvreuse.chunk_cache.recompute import Recompute, choose_spans
from vllm_kvreuse.chunk_cache.stats import COUNTERS
from vllm_kvreuse.chunk_cache.store import ChunkIndex
from vllm_kvreuse.config import KVReuseConfig
from vllm_kvreuse.core.upstream import Upstream, block_ids

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig


class ChunkScheduler:
    """Plans, fills and the store index, in the engine core."""

    def __init__(
        self, vllm_config: Any, kv_cache_config: KVCacheConfig, block_size: int
    ) -> None:
        settings = KVReuseConfig.from_vllm_config(vllm_config)
        self.block_size = block_size
        self.mode = settings.chunk_attention
        self.recompute = Recompute(
            head=settings.chunk_recompute_head,
            select=settings.chunk_recompute_select,
            tail=settings.chunk_recompute_fraction,
        )
        self._max_model_len = vllm_config.model_config.max_model_len
        self.fill_context = load_fill_context(vllm_config, settings.chunk_fill_context)
        # The mode as keys and salts name it (with the fill context's hash).
        self._attention = attention_tag(self.mode, self.fill_context)
        self._hasher = key_hasher(vllm_config, settings.chunk_cache_hash)
        self._identity = model_identity(vllm_config, self._attention)
        kv_bytes = sum(tensor.size for tensor in kv_cache_config.kv_cache_tensors)
        bytes_per_token = kv_bytes // (kv_cache_config.num_blocks * block_size)
        self.index = ChunkIndex(
            capacity={
                "device": int(kv_bytes * settings.chunk_cache_device_fraction),
                "cpu": int(settings.chunk_cache_cpu_gib * 2**30),
            },
            bytes_per_token=max(bytes_per_token, 1),
        )
        self.plans: dict[str, ChunkPlan] = {}
        self.fills: dict[str, tuple[FillSpec, Request]] = {}  # by fill request id
        # request id -> the load region [start, stop) its next scheduled step
        # loads (set on admission, or by advance() between steps)
        self._loads: dict[str, tuple[int, int]] = {}
        self._offered: dict[str, int] = {}  # request id -> end of the offered load
        self._kv_cache_manager: KVCacheManager | None = None
        self.admin_pins: set[bytes] = set()
        self._reported: dict[str, int] = {}

    def block_salt(self, plan: ChunkPlan, lengths: list[int]) -> str:
        """The cache salt of a chunked request's blocks: their values depend
        on the mode, the segment lengths and which spans were recomputed."""
        spans = ";".join(f"{a}-{b}" for a, b in plan.spans)
        attention = f"{self._attention}+{spans}" if spans else self._attention
        return chunked_salt(plan.user_salt, attention, lengths)

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._kv_cache_manager = kv_cache_manager

    # -- planning --------------------------------------------------------------

    def key_salt(self, cache_salt: str | None, lora_request: Any) -> str:
        return "|".join((cache_salt or "", getattr(lora_request, "lora_name", "")))

    def context_of(self, system: list[int]) -> list[int]:
        """What a chunk after the first is computed after: the system prompt
        in "system" mode, then the fill context."""
        return [*(system if self.mode == "system" else ()), *self.fill_context]

    def key_of(self, cache_salt: str | None, context: Any, tokens: Any) -> bytes:
        """The store key of ``tokens`` computed after ``context``."""
        salt = self.key_salt(cache_salt, None)
        return chunk_key(self._hasher, self._identity, salt, context, tokens)

    def plan(
        self, request: Request, lengths: list[int], recompute: Recompute | None = None
    ) -> tuple[ChunkPlan, list[FillSpec], int] | None:
        """Keys, pins and reservations for ``request``: its plan, the fills it
        needs, and how many of its chunk tokens were not stored yet. None,
        holding nothing, if the store cannot take a missing chunk."""
        prompt = request.prompt_token_ids or []
        later = tuple(self.context_of(prompt[: lengths[0]]))
        salt = self.key_salt(request.cache_salt, request.lora_request)
        chunks: list[PlannedChunk] = []
        start = 0
        for number, length in enumerate(lengths):
            context = later if number else ()
            tokens = prompt[start : start + length]
            key = chunk_key(self._hasher, self._identity, salt, context, tokens)
            chunks.append(PlannedChunk(key, start, length, context))
            start += length
        settings = self.recompute if recompute is None else recompute
        spans = choose_spans(prompt, lengths, settings)
        plan = ChunkPlan(chunks, user_salt=request.cache_salt, spans=spans)
        stored = [
            plan.num_loaded(chunk.start, chunk.start + chunk.length)
            for chunk in chunks
            if (entry := self.index.get(chunk.key)) is not None and entry.ready
        ]
        fills = self.hold_chunks(prompt, chunks)
        stats = self.index.stats
        if fills is None:
            stats.degraded += 1
            return None
        stats.hits += len(stored)
        stats.hit_tokens += sum(stored)
        stats.misses += len(fills)
        stats.miss_tokens += sum(fill.length for fill in fills)
        self.plans[request.request_id] = plan
        return plan, fills, plan.num_loaded() - sum(stored)

    def hold_chunks(
        self, prompt: list[int], chunks: list[PlannedChunk]
    ) -> list[FillSpec] | None:
        """Pins every chunk for the plan; reserves room for those not stored
        or being filled and returns their fills (the caller starts them).
        None, holding nothing, if the store cannot take one of them, or one's
        fill (its context and itself) would not fit the model's length.

        A reserved entry carries two pins: its fill's (dropped when the fill
        finishes) and the plan's (dropped when the load is built), so the
        chunk stays stored between the two.
        """
        index = self.index
        pinned: list[bytes] = []
        fills: list[FillSpec] = []
        for chunk in chunks:
            if index.get(chunk.key) is None:
                # A fill computes its context too, and leaves room for its token.
                too_long = len(chunk.context) + chunk.length >= self._max_model_len
                if too_long or not index.reserve(chunk.key, chunk.length):
                    for key in pinned:
                        index.unpin(key)
                    for fill in fills:
                        index.drop(fill.key)
                    return None
                tokens = prompt[chunk.start : chunk.start + chunk.length]
                fills.append(
                    FillSpec(chunk.key, [*chunk.context, *tokens], len(chunk.context))
                )
            index.pin(chunk.key)  # the plan's pin
            pinned.append(chunk.key)
        return fills

    def repin(self, request: Request) -> list[FillSpec] | None:
        """A preempted or re-planned request loads its chunks again: pins
        them again and returns fills for any no longer stored; None if the
        store cannot take them (the plan is dropped: the caller runs the
        request as an ordinary one)."""
        plan = self.plans.get(request.request_id)
        if plan is None or plan.pinned:
            return []
        fills = self.hold_chunks(request.prompt_token_ids or [], plan.chunks)
        if fills is None:
            del self.plans[request.request_id]
            self.index.stats.degraded += 1
            return None
        plan.pinned = True
        return fills

    def add_fill(self, request: Request, fill: FillSpec) -> None:
        """``request`` computes ``fill``; its chunk is saved in the step that
        finishes its prefill."""
        self.fills[request.request_id] = (fill, request)

    def fill_finished(self, request_id: str) -> list[str]:
        """A fill left the engine. If it did not save its chunk, the chunk
        leaves the index and the requests that were waiting for it are
        unpinned and returned: the caller plans them again."""
        running = self.fills.pop(request_id, None)
        if running is None:
            return []
        fill = running[0]
        entry = self.index.get(fill.key)
        if entry is not None and entry.ready:
            self.index.unpin(fill.key)
            return []
        self.index.drop(fill.key)
        waiters = [
            request_id
            for request_id, plan in self.plans.items()
            if request_id not in self._loads
            and any(chunk.key == fill.key for chunk in plan.chunks)
        ]
        for request_id in waiters:
            self._unpin(self.plans[request_id])
        self.index.stats.replanned += len(waiters)
        return waiters

    def drop_plan(self, request_id: str) -> ChunkPlan | None:
        plan = self.plans.pop(request_id, None)
        if plan is not None:
            self._unpin(plan)
        return plan

    def is_ready(self, plan: ChunkPlan) -> bool:
        return all(
            (entry := self.index.get(chunk.key)) is not None and entry.ready
            for chunk in plan.chunks
        )

    def stored_tokens_past(self, request_id: str, num_local: int) -> int | None:
        """Tokens of stored chunks past ``num_local`` that the request loads
        (recomputed spans excluded); None without a plan."""
        plan = self.plans.get(request_id)
        if plan is None:
            return None
        return sum(
            plan.num_loaded(max(num_local, chunk.start), chunk.start + chunk.length)
            for chunk in plan.chunks
            if (entry := self.index.get(chunk.key)) is not None and entry.ready
        )

    def compute_stop(self, request_id: str, num_computed: int) -> int | None:
        """Where a prefill of ``request_id`` from ``num_computed`` must stop
        (the end of its recomputed span); None: no limit."""
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

    def forget_load(self, request_id: str) -> None:
        """A preempted request's pending load: its blocks are gone."""
        self._loads.pop(request_id, None)

    # -- vLLM's connector calls -------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        plan = self.plans.get(request.request_id)
        if plan is None or num_computed_tokens >= plan.last_load_end:
            return 0, False
        if not self.is_ready(plan):
            return None, False  # a fill is still running: wait, holding nothing
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
        if self._loads:
            scheduled = scheduler_output.num_scheduled_tokens
            for request_id in [r for r in self._loads if r in scheduled]:
                start, stop = self._loads.pop(request_id)
                plan = self.plans[request_id]
                blocks = self._block_ids(request_id)
                meta.loads.append(
                    LoadSpec(request_id, blocks, plan.pieces(start, stop))
                )
                if stop >= plan.last_load_end:
                    self._unpin(plan)
            if meta.loads:  # a running request's load feeds this step's forward
                scheduler_output.has_sync_kv_loads = True
        if self.fills:
            self._add_saves(meta, scheduler_output.num_scheduled_tokens)
        if self.index.pending_ops:
            meta.ops = self.index.take_ops()
        return meta

    def _add_saves(self, meta: ChunkMeta, scheduled: dict[str, int]) -> None:
        """Saves of the fills whose chunk is computed by the end of this step."""
        for request_id, (fill, request) in self.fills.items():
            if request_id not in scheduled or self.index.get(fill.key) is None:
                continue
            if request.num_computed_tokens + scheduled[request_id] < len(fill.prompt):
                continue
            meta.saves.append(
                SaveSpec(fill.key, self._block_ids(request_id), fill.start, fill.length)
            )
            self.index.mark_ready(fill.key)

    def request_finished(self, request: Request) -> None:
        self._loads.pop(request.request_id, None)
        self._offered.pop(request.request_id, None)
        self.drop_plan(request.request_id)

    # -- stats and admin -------------------------------------------------------

    def snapshot(self) -> dict[str, int]:
        """Counter totals and current gauges (O(1): it runs every step)."""
        index = self.index
        stats = index.stats
        return {
            **{name: getattr(stats, name) for name in COUNTERS},
            "chunks": len(index.entries),
            "stored_tokens": index.stored_tokens,
            "pinned": index.num_pinned,
            "device_bytes": index.bytes_in("device"),
            "cpu_bytes": index.bytes_in("cpu"),
            "fills": len(self.fills),
            "waiting": self.num_waiting() if self.fills else 0,
        }

    def num_waiting(self) -> int:
        """Chunked requests waiting for a fill to store one of their chunks."""
        return sum(
            1
            for request_id, plan in self.plans.items()
            if request_id not in self._loads and not self.is_ready(plan)
        )

    def stats_since_last_report(self) -> dict[str, int] | None:
        now = self.snapshot()
        if now == self._reported:
            return None
        data = {
            name: value - self._reported.get(name, 0) if name in COUNTERS else value
            for name, value in now.items()
        }
        self._reported = now
        return data

    # -- helpers ---------------------------------------------------------------

    def _unpin(self, plan: ChunkPlan) -> None:
        if plan.pinned:
            plan.pinned = False
            for chunk in plan.chunks:
                self.index.unpin(chunk.key)

    def _block_ids(self, request_id: str) -> list[int]:
        assert self._kv_cache_manager is not None
        return list(block_ids(self._kv_cache_manager, request_id)[0])
