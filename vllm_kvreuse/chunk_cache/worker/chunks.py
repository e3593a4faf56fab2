"""The chunk cache's worker side: stored chunk tensors, loads and saves.

Each worker holds the stored chunks (``[layers, 2, n, H, D]`` tensors on the
KV cache's device, or in host memory for the CPU tier) and applies what the
scheduler side decided for the step
(:class:`~vllm_kvreuse.chunk_cache.engine.plan.ChunkMeta`), in order: store
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
from vllm_kvreuse.chunk_cache.engine.keys import ChunkKey
from vllm_kvreuse.chunk_cache.engine.plan import ChunkMeta, LoadSpec, SaveSpec

logger = init_logger(__name__)


class ChunkWorker:
    """Stored chunks and the device ops over this worker's KV caches."""

    def __init__(self, vllm_config: Any, block_size: int) -> None:
        self._vllm_config = vllm_config
        self.block_size = block_size
        self.ops: device.DeviceOps | None = None
        self.stored: dict[ChunkKey, torch.Tensor] = {}  # [layers, 2, n, H, D]
        self._load_errors: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from vllm_kvreuse.chunk_cache.worker.rope import model_rope

        context = self._vllm_config.compilation_config.static_forward_context
        self.ops = device.build_ops(
            kv_caches, context, self.block_size, model_rope(self._vllm_config)
        )
        self.ops.warm_up()  # kernels compile here, at start, not in a request

    def before_forward(self, meta: ChunkMeta) -> None:
        """Store decisions, then this step's loads."""
        for op in meta.ops:
            if op.kind == "evict":
                self.stored.pop(op.key, None)
            elif op.key in self.stored:
                self.stored[op.key] = self.stored[op.key].to("cpu")
        for load in meta.loads:
            self._load(load)

    def after_forward(self, meta: ChunkMeta) -> None:
        """This step's saves: chunks its forward pass computed."""
        for save in meta.saves:
            self._save(save)

    def take_load_errors(self) -> set[int]:
        """Blocks whose load failed (vLLM fails or recomputes their requests)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

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
        missing = [piece for piece in load.pieces if piece.key not in self.stored]
        if missing:
            # The scheduler side admits a load only once every chunk is
            # saved, so this is a defect; report it the way vLLM expects
            # (the request fails alone) rather than take the worker down.
            logger.error(
                "vllm-kvreuse: %d chunk(s) of request %s are not stored",
                len(missing),
                load.request_id,
            )
            self._load_errors.update(load.block_ids)
            return
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
