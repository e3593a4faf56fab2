"""Per-layer :class:`PagedKV` views of the KV caches vLLM allocates.

A layer's cache tensor, as vLLM hands it to a KV connector, depends on the
attention backend (and, on CPU, on the kernels' ISA). Each known layout has a
function here that builds the views from that tensor alone; anything else is
refused with the backend's name, so a new layout is never guessed at.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_kvreuse.device.base import PagedKV, UnsupportedKVLayout


def cpu_attn_views(cache: torch.Tensor, block_size: int, isa: str | None) -> PagedKV:
    """vLLM's CPU attention, ``vec`` kernels (x86 without AMX, or float32 /
    float16): ``[num_blocks, H, block_size, 2 * D]`` where each (block, head)
    holds its keys transposed (``[D, block_size]``), then its values row by
    row (``[block_size, D]``)."""
    if isa != "vec":
        raise UnsupportedKVLayout(
            f"the CPU attention kernels {isa!r} pack KV in a layout the chunk "
            "cache does not address; use dtype float32 or float16"
        )
    num_blocks, num_heads, rows, width = cache.shape
    head_size = width // 2
    if rows != block_size or not cache.is_contiguous():
        raise UnsupportedKVLayout(f"CPU_ATTN cache {tuple(cache.shape)}")
    rows_view = cache.view(num_blocks, num_heads, 2 * block_size, head_size)
    block_stride, head_stride = rows_view.stride()[:2]
    transposed_keys = cache.as_strided(
        (num_blocks, num_heads, head_size, block_size),
        (block_stride, head_stride, block_size, 1),
        cache.storage_offset(),
    )
    return PagedKV(
        keys=transposed_keys.permute(0, 3, 1, 2),
        values=rows_view[:, :, block_size:].transpose(1, 2),
    )


def kv_first_views(cache: torch.Tensor, block_size: int) -> PagedKV | None:
    """``[2, num_blocks, block_size, H, D]``, keys first; None if not that."""
    if cache.dim() == 5 and cache.shape[0] == 2 and cache.shape[2] == block_size:
        return PagedKV(keys=cache[0], values=cache[1])
    return None


def cpu_attn_isa(layer: Any, cache: torch.Tensor, block_size: int) -> str:
    """The ISA vLLM's CPU attention picked for ``layer`` (its KV packing)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(cache.dtype, block_size, layer.head_size, layer.kv_cache_dtype)


def layer_views(layer: Any, cache: Any, block_size: int) -> PagedKV:
    """Views of one layer's cache as vLLM allocated it for ``layer``'s backend.

    ``layer`` is the attention module from vLLM's static forward context.
    """
    backend = layer.attn_backend.get_name()
    if backend == "CPU_ATTN":
        return cpu_attn_views(cache, block_size, cpu_attn_isa(layer, cache, block_size))
    if isinstance(cache, torch.Tensor) and (views := kv_first_views(cache, block_size)):
        return views
    shape = tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache)
    raise UnsupportedKVLayout(
        f"KV cache layout of attention backend {backend} (shape {shape}) is not "
        "supported by the chunk cache; pick another with --attention-backend"
    )
