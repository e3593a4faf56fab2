"""vllm-ascend's per-layer KV cache, built on any device as its runner builds it.

Mirrors ``NPUModelRunner._allocate_kv_cache_tensors`` and
``_reshape_kv_cache_tensors`` (vllm-ascend main, ``vllm_ascend/worker/
model_runner_v1.py``) for a full-attention layer: the layer's page is split
between K and V by ``calc_split_factor([D, D])`` (halves), each half an int8
buffer (offset to a 2 MiB boundary when a KV connector is configured, as the
chunk cache's is), viewed in the KV dtype as
``AscendAttentionBackend.get_kv_cache_shape(...)[1:]``, that is
``[num_kernel_blocks, kernel_block_size, num_kv_heads, head_size]``.
"""

from __future__ import annotations

import torch

ASCEND_BLOCK_SIZE = 128
"""``AscendAttentionBackend.get_supported_kernel_block_sizes()[0]``."""

CONNECTOR_ALIGNMENT = 2 * 1024 * 1024
"""``_allocate_kv_cache_tensors``' alignment with a KV connector."""


def int8_buffer(
    numel: int, device: torch.device | str, with_connector: bool
) -> torch.Tensor:
    """``_allocate_int8_cache_tensor``: zeros, aligned when a connector is set."""
    if not with_connector:
        return torch.zeros(numel, dtype=torch.int8, device=device)
    raw = torch.zeros(numel + CONNECTOR_ALIGNMENT, dtype=torch.int8, device=device)
    pointer = raw.data_ptr()
    aligned = -(-pointer // CONNECTOR_ALIGNMENT) * CONNECTOR_ALIGNMENT
    return raw[aligned - pointer :][:numel]


def ascend_layer(
    num_blocks: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    *,
    block_size: int = ASCEND_BLOCK_SIZE,
    kernel_block_size: int | None = None,
    device: torch.device | str = "cpu",
    with_connector: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One attention layer's ``(k_cache, v_cache)`` for ``num_blocks``
    scheduler blocks of ``block_size`` tokens (each split into kernel blocks
    of ``kernel_block_size`` where that is smaller, as with hybrid blocks)."""
    kernel_block_size = kernel_block_size or block_size
    splits = block_size // kernel_block_size
    kv_cache_shape = (
        2,
        num_blocks * splits,
        kernel_block_size,
        num_kv_heads,
        head_size,
    )  # AscendAttentionBackend.get_kv_cache_shape
    page_size_bytes = 2 * block_size * num_kv_heads * head_size * dtype.itemsize
    layer_bytes = num_blocks * page_size_bytes
    halves = (layer_bytes // 2, layer_bytes // 2)  # calc_split_factor([D, D])
    k_cache, v_cache = (
        int8_buffer(size, device, with_connector).view(dtype).view(kv_cache_shape[1:])
        for size in halves
    )
    return k_cache, v_cache
