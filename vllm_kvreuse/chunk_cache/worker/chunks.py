"""The chunk cache's worker side: stored chunk tensors, loads and saves.

Each worker holds the stored chunks (``[layers, 2, n, H, D]`` tensors on the
KV cache's device, in host memory, on disk or in the shared store:
:mod:`.tiers`) and applies what the scheduler side decided for the step
(:class:`~vllm_kvreuse.chunk_cache.messages.ChunkMeta`), in order: store
decisions and loads before the forward pass, saves after it. Every KV tensor
access goes through :mod:`vllm_kvreuse.device`.

A step without chunk work never reaches this class: the connector binds
only non-empty metadata (``KVReuseChunkConnector.bind_connector_metadata``).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.logger import init_logger

from vllm_kvreuse import device
from vllm_kvreuse.chunk_cache.messages import ChunkMeta, LoadSpec, SaveSpec
from vllm_kvreuse.chunk_cache.tiers.codec import ChunkKey, Layout, Meta
from vllm_kvreuse.chunk_cache.tiers.opening import open_tiers
from vllm_kvreuse.chunk_cache.worker.tiers import LocalTiers
from vllm_kvreuse.core.spec import settings_of
from vllm_kvreuse.device.host_copy import HostCopies

logger = init_logger(__name__)


class ChunkWorker:
    """Stored chunks (:class:`~.tiers.LocalTiers`) and the device ops over
    this worker's KV caches."""

    def __init__(self, vllm_config: Any, block_size: int) -> None:
        self._vllm_config = vllm_config
        self.block_size = block_size
        self.ops: device.DeviceOps | None = None
        self.tiers: LocalTiers | None = None
        self._load_errors: set[int] = set()

    @property
    def stored(self) -> dict[ChunkKey, torch.Tensor]:
        """The chunks in memory (device and CPU tiers)."""
        return self.tiers.memory if self.tiers is not None else {}

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from vllm_kvreuse.chunk_cache.worker.rope import model_rope

        context = self._vllm_config.compilation_config.static_forward_context
        self.ops = device.build_ops(
            kv_caches, context, self.block_size, model_rope(self._vllm_config)
        )
        self.ops.warm_up()  # kernels compile here, at start, not in a request
        self.tiers = worker_tiers(self._vllm_config, self.ops)

    def before_forward(self, meta: ChunkMeta) -> None:
        """Store decisions (publishes wait for the saves), then this step's
        loads."""
        assert self.tiers is not None
        for op in meta.ops:
            if op.kind != "publish":
                self.tiers.apply(op)
        assert self.ops is not None
        if meta.loads:  # every request's pieces at once: fused ops, one launch
            self.ops.load_chunks([self._pieces(load) for load in meta.loads])

    def after_forward(self, meta: ChunkMeta) -> None:
        """This step's saves (chunks its forward pass computed), then their
        writes to the shared store."""
        assert self.tiers is not None
        for save in meta.saves:
            self._save(save)
        for op in meta.ops:
            if op.kind == "publish":
                self.tiers.publish(op.key, op.meta)

    def take_load_errors(self) -> set[int]:
        """Blocks whose load failed (vLLM recomputes their requests)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        """Waits for the tiers' background writes."""
        if self.tiers is not None:
            self.tiers.close()

    def take_lost(self) -> set[ChunkKey]:
        """Chunks this worker could not read since the last call."""
        return self.tiers.take_lost() if self.tiers is not None else set()

    def take_dropped(self) -> int:
        """Background writes this worker could not queue since the last call."""
        return self.tiers.take_dropped() if self.tiers is not None else 0

    def _block_table(self, block_ids: list[int]) -> torch.Tensor:
        assert self.ops is not None
        return torch.tensor(block_ids, device=self.ops.device)

    def _save(self, save: SaveSpec) -> None:
        assert self.ops is not None and self.tiers is not None
        chunk = self.ops.save_chunk(
            self._block_table(save.block_ids), save.start, save.length
        )
        self.tiers.put(save.key, chunk, Meta(save.length, save.start, save.origin))

    def _pieces(self, load: LoadSpec) -> device.ChunkLoad:
        """Every piece of ``load`` whose chunk is here, as the plan names it
        (computed at the same position, of the same origin); the blocks of
        the others are reported (vLLM recomputes from the first of them).

        The block table stays on the host: the ops copy every request's
        with their piece table, once a step."""
        assert self.tiers is not None
        pieces = []
        for piece in load.pieces:
            chunk, meta = self.tiers.get(piece.key), self.tiers.meta(piece.key)
            if (
                chunk is None  # lost by its tier (counted by the scheduler)
                or meta is None
                or (meta.start, meta.origin) != (piece.stored_start, piece.origin)
                or meta.num_tokens < piece.src_start + piece.count
            ):  # or another chunk stored under the key since the plan was made
                first = piece.dst_start // self.block_size
                last = (piece.dst_start + piece.count - 1) // self.block_size
                self._load_errors.update(load.block_ids[first : last + 1])
                continue
            pieces.append(device.ChunkPiece(chunk, piece.src_start,
                                            piece.dst_start, piece.count,
                                            piece.delta))  # fmt: skip
        return device.ChunkLoad(torch.tensor(load.block_ids), pieces)


def worker_tiers(vllm_config: Any, ops: device.DeviceOps) -> LocalTiers:
    """This worker rank's tiers, from the plugin's settings. Bytes read
    from disk or the shared store must be of this rank's KV layout."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    tp, pp = get_tp_group(), get_pp_group()
    rank = pp.rank_in_group * tp.world_size + tp.rank_in_group
    ranks = pp.world_size * tp.world_size
    settings, layout = settings_of(vllm_config), Layout(*ops.chunk_layout)
    disk, shared = open_tiers(vllm_config, settings, rank, ranks, layout)
    copies = HostCopies.for_device(ops.device)
    return LocalTiers(ops.device, disk, shared, host_copies=copies)
