"""The chunk cache as a vLLM KV connector (``kv_connector_module_path``).

vLLM builds one instance per role:

- **Scheduler side** (engine core): owns the :class:`ChunkIndex` and the
  plans of chunked requests. It answers ``get_num_new_matched_tokens`` with
  the tokens a request's chunks cover, and each step packs the workers'
  work into :class:`ChunkMeta`: store decisions, fills to save, loads.
- **Worker side**: holds the stored chunk tensors and does the work with
  :mod:`vllm_kvreuse.device` (read, re-rotate, write).

Data flow: :class:`~vllm_kvreuse.chunk_cache.scheduler.ChunkCacheMixin`
registers plans and fills → this connector → workers. Nothing flows back but
vLLM's own "finished receiving" ids.

A load is *sync* when every chunk it needs is stored at admission: the
worker writes it before the step's forward pass. Otherwise it is *async*:
vLLM parks the request in ``WAITING_FOR_REMOTE_KVS`` with its blocks
allocated, the fills of its missing chunks run as ordinary requests, and the
worker writes the request's chunks after the step whose forward pass saved
the last of them, then reports it as received.

Block ownership: the connector never owns KV blocks. It writes into blocks
vLLM allocated to the loading request and reads blocks of a fill request in
the step that computed them; stored chunks live outside the KV pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from vllm_kvreuse import device
from vllm_kvreuse.chunk_cache.keys import ChunkKey
from vllm_kvreuse.chunk_cache.stats import (
    COUNTERS,
    ChunkCachePromMetrics,
    ChunkCacheStats,
)
from vllm_kvreuse.chunk_cache.store import ChunkIndex, StoreOp
from vllm_kvreuse.config import KVReuseConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)


@dataclass(frozen=True, slots=True)
class PlannedChunk:
    """One chunk of a chunked request: where it stands and where it was computed."""

    key: ChunkKey
    start: int  # first position in the request
    length: int
    virtual_start: int  # position of its first token when it was computed


@dataclass(slots=True)
class ChunkPlan:
    """A chunked request's chunks, laid end to end from position 0."""

    chunks: list[PlannedChunk]
    user_salt: str | None = None  # the request's own cache_salt
    pinned: bool = True

    @property
    def end(self) -> int:
        last = self.chunks[-1]
        return last.start + last.length


@dataclass(frozen=True, slots=True)
class Fill:
    """A fill request: computes one chunk; its KV is saved when prefilled."""

    key: ChunkKey
    request: Request
    start: int  # where the chunk starts in the fill's prompt
    length: int


@dataclass(frozen=True, slots=True)
class Piece:
    key: ChunkKey
    src_start: int  # first token within the stored chunk
    dst_start: int  # its position in the request
    count: int
    delta: int  # actual minus virtual position


@dataclass(frozen=True, slots=True)
class LoadSpec:
    request_id: str
    block_ids: list[int]
    pieces: list[Piece]
    sync: bool


@dataclass(frozen=True, slots=True)
class SaveSpec:
    key: ChunkKey
    block_ids: list[int]
    start: int
    length: int


@dataclass(slots=True)
class ChunkMeta(KVConnectorMetadata):
    """One step's work for the workers, applied in this order."""

    ops: list[StoreOp] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)  # pending loads to drop
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


class KVReuseChunkConnector(KVConnectorBase_V1):
    """Loads content-addressed chunk KV into requests; saves computed chunks."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = KVReuseConfig.from_vllm_config(vllm_config)
        assert kv_cache_config is not None
        self.block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler(kv_cache_config)
        else:
            self._init_worker()

    # -- scheduler side ---------------------------------------------------------

    def _init_scheduler(self, kv_cache_config: KVCacheConfig) -> None:
        kv_bytes = sum(tensor.size for tensor in kv_cache_config.kv_cache_tensors)
        bytes_per_token = kv_bytes // (kv_cache_config.num_blocks * self.block_size)
        self.index = ChunkIndex(
            capacity={
                "device": int(kv_bytes * self.settings.chunk_cache_device_fraction),
                "cpu": int(self.settings.chunk_cache_cpu_gib * 2**30),
            },
            bytes_per_token=max(bytes_per_token, 1),
        )
        self.plans: dict[str, ChunkPlan] = {}
        self.fills: dict[str, Fill] = {}
        self._loads: dict[str, tuple[int, bool]] = {}  # request id -> (start, sync)
        self._kv_cache_manager: KVCacheManager | None = None
        self._reported: dict[str, int] = {}
        self._waiting_loads: set[str] = set()  # async loads not yet received
        self._cancelled: list[str] = []

    def snapshot(self) -> dict[str, int]:
        """Totals of the counters and current gauges of the store (O(1): it
        runs after every step)."""
        index = self.index
        stats = index.stats
        return {
            **{name: getattr(stats, name) for name in COUNTERS},
            "chunks": len(index.entries),
            "stored_tokens": index.stored_tokens,
            "pinned": index.num_pinned,
            "device_bytes": index.bytes_in("device"),
            "cpu_bytes": index.bytes_in("cpu"),
        }

    def get_kv_connector_stats(self) -> ChunkCacheStats | None:
        if self._role != KVConnectorRole.SCHEDULER:
            return None
        now = self.snapshot()
        if now == self._reported:
            return None
        data = {
            name: value - self._reported.get(name, 0) if name in COUNTERS else value
            for name, value in now.items()
        }
        self._reported = now
        return ChunkCacheStats(data=data)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> ChunkCacheStats:
        return ChunkCacheStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, *args: Any, **kwargs: Any) -> ChunkCachePromMetrics:
        return ChunkCachePromMetrics(*args, **kwargs)

    def reset_cache(self) -> bool:
        """Evicts every unpinned chunk (vLLM's reset_prefix_cache with
        ``reset_external``)."""
        if self._role == KVConnectorRole.SCHEDULER:
            self.index.clear()
        return True

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._kv_cache_manager = kv_cache_manager

    def add_plan(self, request_id: str, plan: ChunkPlan) -> None:
        """Registers a chunked request; its chunks stay pinned until it loads."""
        self.plans[request_id] = plan

    def add_fill(self, fill: Fill) -> None:
        self.fills[fill.request.request_id] = fill

    def fill_finished(self, request_id: str) -> None:
        """A fill left the engine; an unsaved chunk is dropped from the index."""
        fill = self.fills.pop(request_id, None)
        if fill is None:
            return
        entry = self.index.get(fill.key)
        if entry is not None and not entry.ready:
            self.index.drop(fill.key)
        else:
            self.index.unpin(fill.key)

    def is_ready(self, plan: ChunkPlan) -> bool:
        return all(
            (entry := self.index.get(chunk.key)) is not None and entry.ready
            for chunk in plan.chunks
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        plan = self.plans.get(request.request_id)
        if plan is None or num_computed_tokens >= plan.end:
            return 0, False
        return plan.end - num_computed_tokens, not self.is_ready(plan)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        plan = self.plans.get(request.request_id)
        if plan is None or not num_external_tokens:
            return
        start = plan.end - num_external_tokens
        self._loads[request.request_id] = (start, self.is_ready(plan))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ChunkMeta:
        meta = ChunkMeta()
        for request_id, (start, sync) in self._loads.items():
            plan = self.plans[request_id]
            meta.loads.append(
                LoadSpec(
                    request_id=request_id,
                    block_ids=self._block_ids(request_id),
                    pieces=self._pieces(plan, start),
                    sync=sync,
                )
            )
            if sync:
                self._unpin(plan)
            else:
                self._waiting_loads.add(request_id)
        self._loads.clear()
        meta.cancelled, self._cancelled = self._cancelled, []
        scheduled = scheduler_output.num_scheduled_tokens
        for request_id, fill in self.fills.items():
            request = fill.request
            if request_id not in scheduled or self.index.get(fill.key) is None:
                continue
            if request.num_computed_tokens + scheduled[request_id] < fill.start + (
                fill.length
            ):
                continue  # its chunk is not computed by the end of this step
            meta.saves.append(
                SaveSpec(fill.key, self._block_ids(request_id), fill.start, fill.length)
            )
            self.index.mark_ready(fill.key)
        meta.ops = self.index.take_ops()
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        for request_id in connector_output.finished_recving or ():
            self._waiting_loads.discard(request_id)
            plan = self.plans.get(request_id)
            if plan is not None:
                self._unpin(plan)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        plan = self.plans.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        if request.request_id in self._waiting_loads:
            # Its blocks go back to the pool now: the worker must never write
            # them, so the pending load is dropped before any later step's
            # loads run.
            self._waiting_loads.discard(request.request_id)
            self._cancelled.append(request.request_id)
        if plan is not None:
            self._unpin(plan)
        return False, None

    def _unpin(self, plan: ChunkPlan) -> None:
        if plan.pinned:
            plan.pinned = False
            for chunk in plan.chunks:
                self.index.unpin(chunk.key)

    def _block_ids(self, request_id: str) -> list[int]:
        assert self._kv_cache_manager is not None
        return list(self._kv_cache_manager.get_block_ids(request_id)[0])

    @staticmethod
    def _pieces(plan: ChunkPlan, start: int) -> list[Piece]:
        """The parts of ``plan``'s chunks at positions ``start`` and later."""
        pieces = []
        for chunk in plan.chunks:
            skip = max(0, start - chunk.start)
            if skip >= chunk.length:
                continue
            pieces.append(
                Piece(
                    key=chunk.key,
                    src_start=skip,
                    dst_start=chunk.start + skip,
                    count=chunk.length - skip,
                    delta=chunk.start - chunk.virtual_start,
                )
            )
        return pieces

    # -- worker side ------------------------------------------------------------

    def _init_worker(self) -> None:
        self.ops: device.DeviceOps | None = None
        self.stored: dict[ChunkKey, torch.Tensor] = {}  # [layers, 2, n, H, D]
        self.waiting: list[LoadSpec] = []
        self.received: set[str] = set()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from vllm_kvreuse.chunk_cache.rope import model_rope

        context = self._vllm_config.compilation_config.static_forward_context
        self.ops = device.build_ops(
            kv_caches, context, self.block_size, model_rope(self._vllm_config)
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ChunkMeta)
        for op in meta.ops:
            if op.kind == "evict":
                self.stored.pop(op.key, None)
            elif op.key in self.stored:
                self.stored[op.key] = self.stored[op.key].to("cpu")
        if meta.cancelled:
            cancelled = set(meta.cancelled)
            self.waiting = [w for w in self.waiting if w.request_id not in cancelled]
        for load in meta.loads:
            if load.sync:
                self._load(load)
            else:
                self.waiting.append(load)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ChunkMeta)
        for save in meta.saves:
            self._save(save)
        still_waiting = []
        for load in self.waiting:
            if all(piece.key in self.stored for piece in load.pieces):
                self._load(load)
                self.received.add(load.request_id)
            else:
                still_waiting.append(load)
        self.waiting = still_waiting

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        self.waiting = [
            load for load in self.waiting if load.request_id not in finished_req_ids
        ]
        received, self.received = self.received, set()
        return None, received or None

    def _block_table(self, block_ids: list[int]) -> torch.Tensor:
        assert self.ops is not None
        return torch.tensor(block_ids, device=self.ops.device)

    def _save(self, save: SaveSpec) -> None:
        assert self.ops is not None
        self.stored[save.key] = self.ops.save_chunk(
            self._block_table(save.block_ids), save.start, save.length
        )

    def _load(self, load: LoadSpec) -> None:
        assert self.ops is not None
        block_ids = self._block_table(load.block_ids)
        for piece in load.pieces:
            self.ops.load_chunk(
                block_ids,
                piece.dst_start,
                self.stored[piece.key],
                piece.src_start,
                piece.count,
                piece.delta,
            )
