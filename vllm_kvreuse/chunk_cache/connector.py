"""The chunk cache as a vLLM KV connector (``kv_connector_module_path``).

A thin facade: vLLM builds one instance per role, and each call goes to the
side that owns the work:
- scheduler role (engine core): :class:`~.engine.planner.ChunkScheduler`,
  the plans, over :class:`~.engine.store.ChunkStore`, the store's owner;
- worker role: :class:`~.worker.chunks.ChunkWorker`, the stored tensors.

Data flow: the feature (:mod:`.feature`) plans chunked requests on the
scheduler side → ``build_connector_meta`` packs a step's loads, saves and
store decisions → the workers carry them out. Loads are synchronous (see
:mod:`.engine.planner` for why), so nothing flows back but load errors and
the chunks a tier lost (``build_connector_worker_meta`` →
``update_connector_output``).

Cost when unused: the scheduler side builds an empty :class:`~.engine.plan.ChunkMeta`
in O(1) (vLLM requires one each step) and the worker binds only non-empty
metadata, so a step that loads and saves nothing makes no per-layer call and
no worker-side chunk call (docs/results/chunk_cache.md, "Cost when unused").

Threads: loads and saves run on the worker's thread; one I/O thread writes
to the disk tier and the shared store when they are set
(:mod:`.worker.tiers`).

Block ownership: the connector never owns KV blocks. It writes into blocks
vLLM allocated to the loading request and reads a request's blocks in the
step that computed a chunk of it; stored chunks live outside the KV pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
)

from vllm_kvreuse.chunk_cache.engine.planner import ChunkScheduler
from vllm_kvreuse.chunk_cache.engine.stats import ChunkCachePromMetrics, ChunkCacheStats
from vllm_kvreuse.chunk_cache.messages import ChunkMeta, ChunkWorkerReport
from vllm_kvreuse.chunk_cache.worker.chunks import ChunkWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KVReuseChunkConnector(KVConnectorBase_V1):
    """Loads content-addressed chunk KV into requests; saves computed chunks."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        assert kv_cache_config is not None
        block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.scheduler_side: ChunkScheduler | None = None
        self.worker_side: ChunkWorker | None = None
        self._chunk_work: ChunkMeta | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = ChunkScheduler(
                vllm_config, kv_cache_config, block_size
            )
        else:
            self.worker_side = ChunkWorker(vllm_config, block_size)

    @property
    def _sched(self) -> ChunkScheduler:
        assert self.scheduler_side is not None, "scheduler-role call on a worker"
        return self.scheduler_side

    @property
    def _worker(self) -> ChunkWorker:
        assert self.worker_side is not None, "worker-role call in the scheduler"
        return self.worker_side

    # -- scheduler role --------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._sched.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ChunkMeta:
        return self._sched.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, self._sched.request_finished(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' report of the step (chunks a tier lost, failed loads)."""
        self._sched.update_connector_output(connector_output)

    def reset_cache(self) -> bool:
        """Evicts every unpinned chunk (``reset_prefix_cache`` with
        ``reset_external``)."""
        if self.scheduler_side is not None:
            self.scheduler_side.store.clear()
        return True

    def get_kv_connector_stats(self) -> ChunkCacheStats | None:
        if self.scheduler_side is None:
            return None
        data = self.scheduler_side.stats_since_last_report()
        return None if data is None else ChunkCacheStats(data=data)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> ChunkCacheStats:
        return ChunkCacheStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, *args: Any, **kwargs: Any) -> ChunkCachePromMetrics:
        return ChunkCachePromMetrics(*args, **kwargs)

    # -- worker role -----------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Binds a step's metadata only if it carries chunk work.

        Invariant: bound metadata is never empty. vLLM's per-layer hook
        (``maybe_transfer_kv_layer``) calls ``wait_for_layer_load`` and
        ``save_kv_layer`` on every attention layer while metadata is bound,
        so a step without chunk work makes no per-layer call at all.
        """
        if connector_metadata:
            super().bind_connector_metadata(connector_metadata)
            self._chunk_work = connector_metadata  # type: ignore[assignment]
        else:
            self.clear_connector_metadata()

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._chunk_work = None

    def _bound(self) -> ChunkMeta | None:
        """This step's chunk work; None in a step without any (what vLLM's
        base class binds, kept here too: it reads its own copy privately)."""
        return self._chunk_work

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if (meta := self._bound()) is not None:
            self._worker.before_forward(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        if (meta := self._bound()) is not None:
            self._worker.after_forward(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self.worker_side else set()

    def shutdown(self) -> None:
        """Finishes the writes to disk and the shared store in flight."""
        if self.worker_side is not None:
            self.worker_side.close()

    def build_connector_worker_meta(self) -> ChunkWorkerReport | None:
        """Chunks a tier could not give this worker since the last step, and
        background writes it could not queue."""
        if self.worker_side is None:
            return None
        lost, dropped = self.worker_side.take_lost(), self.worker_side.take_dropped()
        return ChunkWorkerReport(lost, dropped) if lost or dropped else None


def find_chunk_connector(connector: object) -> KVReuseChunkConnector | None:
    """The chunk cache's connector: ``connector`` itself, or the child of a
    ``MultiConnector`` (its public ``sub_connectors``); None if neither."""
    if isinstance(connector, KVReuseChunkConnector):
        return connector
    if isinstance(connector, MultiConnector):
        for child in connector.sub_connectors:
            if isinstance(child, KVReuseChunkConnector):
                return child
    return None
