"""Per-layer :class:`PagedKV` views of the KV caches vLLM allocates.

What a KV connector receives, per layer, in vLLM 0.32 (``allocate_kv_cache``
in ``vllm/v1/worker/utils.py``, registered unchanged by both GPU model
runners): a 4-D view ``[B, H, N, C]`` of one int8 buffer shared by all
layers (``create_kv_cache_views``, ``vllm/v1/kv_cache_interface.py``), typed
as the KV cache dtype. ``B`` counts kernel blocks (a manager block is split
into ``block_size // N`` of them when the backend asks for smaller blocks),
``H`` the layer's KV heads, ``N`` the tokens of a kernel block and ``C`` one
head's content for one token. The strides are those of the model-wide
:class:`~vllm.v1.kv_cache_layout.KVCacheLayout` the engine resolved (the
logical order is fixed; only memory order varies).

How ``C`` holds a token's key and value depends on the attention backend:

- FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION, FLASHINFER (dense dtypes): keys
  then values, ``C = 2 * head_size``. Each splits the cache the same way in
  its forward and cache update, ``kv_cache.transpose(1, 2).split(head_size,
  dim=-1)`` (flash_attn.py:1252 and :1443, triton_attn.py:625 and :796,
  flex_attention.py:1233 and :1346, flashinfer.py:2168 and :2656).
- CPU_ATTN: the whole ``[N, C]`` page of a (block, head) is repacked per ISA;
  see :func:`cpu_attn_views` (``vec``, ``vec16``) and
  :mod:`vllm_kvreuse.device.cpu_amx` (``amx``).

Anything else (quantized KV, packed scales, NVFP4 head slots, other
backends) is refused with the backend's name, so a layout is never guessed.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import torch
from vllm.v1.kv_cache_interface import KVCacheLayout, is_quantized_kv_cache

from vllm_kvreuse.core.upstream import worker as upstream
from vllm_kvreuse.device.base import PagedKV, UnsupportedKVLayout
from vllm_kvreuse.device.cpu_amx import amx_views

CONTENT_PACKED_BACKENDS = frozenset(
    {"FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "FLASHINFER"}
)
"""Backends whose ``C`` is one head's key followed by its value."""

SUPPORTED_BACKENDS = ("CPU_ATTN", *sorted(CONTENT_PACKED_BACKENDS))

DENSE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def layer_views(
    layer: Any,
    cache: Any,
    block_size: int,
    layout: KVCacheLayout | None = None,
) -> PagedKV:
    """Views of one layer's cache as vLLM allocated it for ``layer``'s backend.

    ``layer`` is the attention module from vLLM's static forward context;
    ``block_size`` the KV cache manager's; ``layout`` the engine's resolved
    layout when known (otherwise the cache's strides must match one the
    backend supports). Raises :class:`UnsupportedKVLayout`.
    """
    backend = layer.attn_backend
    name = backend.get_name()
    if name == "CPU_ATTN":
        check_dense_cache(layer, cache, block_size)
        check_layout(cache, backend, layout)
        isa = cpu_attn_isa(layer, cache, block_size)
        return cpu_attn_views(cache, block_size, isa)
    if name in CONTENT_PACKED_BACKENDS:
        check_dense_cache(layer, cache, block_size)
        check_layout(cache, backend, layout)
        return content_packed_views(cache, layer.head_size)
    raise unsupported(name, cache, "is not one the chunk cache addresses")


def unsupported(backend: str, cache: Any, why: str) -> UnsupportedKVLayout:
    shape = tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache)
    return UnsupportedKVLayout(
        f"KV cache layout of attention backend {backend} (shape {shape}) {why}; "
        f"the chunk cache supports {', '.join(SUPPORTED_BACKENDS)}: pick one "
        "with --attention-backend"
    )


def content_packed_views(cache: torch.Tensor, head_size: int) -> PagedKV:
    """``[B, H, N, 2 * head_size]`` (any strides) -> keys and values
    ``[B, N, H, head_size]``, the split the CUDA backends make themselves."""
    keys, values = cache.transpose(1, 2).split(head_size, dim=-1)
    return PagedKV(keys=keys, values=values)


def check_dense_cache(layer: Any, cache: Any, block_size: int) -> None:
    """Refuses caches whose content is not one key and one value per head
    in the model's dtype (quantized KV, packed scales, NVFP4 head slots)."""
    name = layer.attn_backend.get_name()
    if is_quantized_kv_cache(layer.kv_cache_dtype):
        raise unsupported(
            name,
            cache,
            f"is quantized (kv_cache_dtype={layer.kv_cache_dtype}); use "
            "--kv-cache-dtype auto",
        )
    expected = (layer.num_kv_heads, 2 * layer.head_size)
    if (
        not isinstance(cache, torch.Tensor)
        or cache.dim() != 4
        or (cache.shape[1], cache.shape[3]) != expected
        or layer.head_size_v != layer.head_size
        or block_size % cache.shape[2]
    ):
        raise unsupported(
            name, cache, f"is not [blocks, {expected[0]}, tokens, {expected[1]}]"
        )
    if cache.dtype not in DENSE_DTYPES or cache.dtype != layer.kv_cache_torch_dtype:
        raise unsupported(name, cache, f"holds {cache.dtype}")


def matching_layouts(
    cache: torch.Tensor, candidates: Iterable[KVCacheLayout]
) -> list[KVCacheLayout]:
    """The layouts whose per-layer memory order the cache's strides follow.

    A layout's ``layer_view_order`` lists the logical ``[B, H, N, C]`` axes
    outermost first; the strides must not increase along it (axes of size
    one carry no order) and ``C`` must be dense.
    """
    if cache.dim() != 4 or cache.stride(3) != 1:
        return []
    found = []
    for layout in candidates:
        strides = [
            cache.stride(axis)
            for axis in layout.layer_view_order
            if cache.shape[axis] > 1
        ]
        if all(outer >= inner for outer, inner in itertools.pairwise(strides)):
            found.append(layout)
    return found


def check_layout(cache: Any, backend: Any, layout: KVCacheLayout | None) -> None:
    """The cache is laid out as ``layout`` (or, unknown, as some layout the
    backend declares in ``supported_kv_cache_layouts``, any if it declares
    none); raises :class:`UnsupportedKVLayout` otherwise."""
    name = backend.get_name()
    if not isinstance(cache, torch.Tensor):
        raise unsupported(name, cache, "is not one tensor")
    declared = backend.supported_kv_cache_layouts() or tuple(KVCacheLayout)
    candidates = [layout] if layout is not None else declared
    if layout is not None and layout not in declared:
        raise unsupported(name, cache, f"uses {layout.name}, not one it declares")
    if not matching_layouts(cache, candidates):
        names = ", ".join(c.name for c in candidates)
        raise unsupported(
            name, cache, f"has strides {cache.stride()}, matching none of {names}"
        )


def cpu_attn_views(cache: torch.Tensor, block_size: int, isa: str | None) -> PagedKV:
    """vLLM's CPU attention KV for the kernels of ``isa``.

    ``vec`` (x86 for float32 and float16, and bfloat16 without AMX) and
    ``vec16`` (head sizes not a multiple of 32) store the same layout:
    ``[num_blocks, H, block_size, 2 * D]`` where each (block, head) holds its
    keys transposed (``[D, block_size]``), then its values row by row
    (``[block_size, D]``). ``amx`` (bfloat16 with AMX tiles) packs tiles:
    :func:`~vllm_kvreuse.device.cpu_amx.amx_views`. Other ISAs (neon, vsx,
    vxe, rvv) are refused: their packing was never measured here.
    """
    if isa == "amx":
        return amx_views(cache, block_size)
    if isa not in ("vec", "vec16"):
        raise UnsupportedKVLayout(
            f"the CPU attention kernels {isa!r} pack KV in a layout the chunk "
            "cache does not address (it addresses x86's vec, vec16 and amx)"
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


def cpu_attn_isa(layer: Any, cache: torch.Tensor, block_size: int) -> str:
    """The ISA vLLM's CPU attention picked for ``layer`` (its KV packing)."""
    return upstream.cpu_attn_isa(
        cache.dtype, block_size, layer.head_size, layer.kv_cache_dtype
    )
