"""Chunk moves over vllm-ascend's KV cache (Ascend NPU).

vllm-ascend's model runner (``NPUModelRunner._reshape_kv_cache_tensors``)
gives each attention layer a tuple ``(k_cache, v_cache)``: two int8 buffers
viewed as ``[num_blocks, block_size, num_kv_heads, head_size]`` in the KV
dtype, keys and values apart, 128-token blocks by default. Its attention
writes them with ``npu_scatter_pa_kv_cache`` (slot ids, int32) and reads
them with ``npu_gather_pa_kv_cache`` (block tables); :class:`AscendOps` does
the same through :mod:`vllm_kvreuse.device.npu_kernels`, whose torch
equivalents run this module unchanged on CPU tensors.

Imported only where vLLM's platform is an NPU (and by the tests).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from vllm_kvreuse.device import npu_kernels as kernels
from vllm_kvreuse.device.base import DeviceOps, PagedKV, Rope, UnsupportedKVLayout


def ascend_views(cache: Any, block_size: int) -> PagedKV:
    """Views of one layer's vllm-ascend cache, ``(k_cache, v_cache)``.

    Each member is ``[num_kernel_blocks, kernel_block_size, H, D]``, one
    contiguous run of memory. Where vllm-ascend splits a scheduler block into
    kernel blocks (``kernel_block_size`` dividing ``block_size``), the split
    blocks are adjacent, so the views regroup them: ``[num_blocks,
    block_size, H, D]``. Refused: other tuples (MLA's differing K/V shapes,
    the C8 and sparse layouts' 1- and 3-tuples), and FRACTAL_NZ storage
    (310P, where ``[blocks, H*D/16, block_size, 16]`` tiles are not
    addressable by torch indexing).
    """
    if not (
        isinstance(cache, (tuple, list))
        and len(cache) == 2
        and all(isinstance(t, torch.Tensor) for t in cache)
    ):
        raise UnsupportedKVLayout(
            f"vllm-ascend KV cache {_describe(cache)} is not a (k_cache, v_cache) "
            "pair; the chunk cache supports its ND attention layout only"
        )
    keys, values = cache
    if any(kernels.storage_format(t) == kernels.ACL_FORMAT_FRACTAL_NZ for t in cache):
        raise UnsupportedKVLayout(
            "vllm-ascend stores this KV cache in FRACTAL_NZ (Atlas 300I/310P or "
            "C8 quantised KV); the chunk cache supports the ND layout only"
        )
    if keys.shape != values.shape or keys.dim() != 4:
        raise UnsupportedKVLayout(f"vllm-ascend KV cache {_describe(cache)}")
    num_kernel_blocks, kernel_block_size, heads, head_size = keys.shape
    splits, remainder = divmod(block_size, kernel_block_size)
    if remainder or num_kernel_blocks % splits:
        raise UnsupportedKVLayout(
            f"vllm-ascend kernel blocks of {kernel_block_size} tokens do not "
            f"tile scheduler blocks of {block_size}: {_describe(cache)}"
        )
    shape = (num_kernel_blocks // splits, block_size, heads, head_size)
    if not (keys.is_contiguous() and values.is_contiguous()):
        raise UnsupportedKVLayout(f"non-contiguous vllm-ascend KV {_describe(cache)}")
    return PagedKV(keys=keys.view(shape), values=values.view(shape))


def slot_ids(
    block_ids: torch.Tensor, start: int, count: int, block_size: int
) -> torch.Tensor:
    """int32 slot ids (``block * block_size + offset``) of positions
    ``[start, start + count)`` of a request whose block table is
    ``block_ids``; vllm-ascend's slot mapping, as its kernels take it."""
    positions = torch.arange(start, start + count, device=block_ids.device)
    blocks = block_ids[positions // block_size]
    return (blocks * block_size + positions % block_size).to(torch.int32)


def block_window(
    block_ids: torch.Tensor, start: int, count: int, block_size: int
) -> tuple[torch.Tensor, int]:
    """The blocks holding positions ``[start, start + count)`` as a one-row
    int32 block table, and the number of tokens before ``start`` in its
    first block: a gather of ``skip + count`` tokens from that table, minus
    its first ``skip``, is exactly those positions."""
    first, skip = divmod(start, block_size)
    end = -(-(start + count) // block_size)  # ceil: the block after the last
    table = block_ids[first:end].to(torch.int32).unsqueeze(0)
    return table, skip


class AscendOps(DeviceOps):
    """Chunk saves and loads over vllm-ascend's ``(k, v)`` layer caches.

    A save gathers each layer's window with one kernel call; a load rotates
    every layer's keys in one pass (kernel launches dominate on an NPU) and
    scatters each layer's keys and values with one call.
    """

    name = "ascend"

    def save_chunk(
        self, block_ids: torch.Tensor, start: int, count: int
    ) -> torch.Tensor:
        table, skip = block_window(block_ids, start, count, self.block_size)
        per_layer = []
        for kv in self.layers:
            keys, values = kernels.gather_sequence(
                kv.keys, kv.values, table, skip + count
            )
            per_layer.append(torch.stack((keys[skip:], values[skip:])))
        return torch.stack(per_layer)

    def write_window(
        self, block_ids: torch.Tensor, start: int, window: torch.Tensor, delta: int
    ) -> None:
        slots = slot_ids(block_ids, start, window.shape[2], self.block_size)
        keys, values = window[:, 0], window[:, 1]
        if delta:
            assert self.rope is not None, "loading at another position needs RoPE"
            keys = kernels.rerotate_keys(keys, delta, self.rope)
        for layer, kv in enumerate(self.layers):
            kernels.scatter_slots(
                keys[layer].to(kv.keys.dtype),
                values[layer].to(kv.values.dtype),
                kv.keys,
                kv.values,
                slots,
            )


def build_ascend_ops(
    kv_caches: Mapping[str, Any], block_size: int, rope: Rope | None
) -> AscendOps:
    """:class:`AscendOps` over ``kv_caches`` (layer name -> ``(k, v)``, as
    vllm-ascend registers them with a KV connector), in registration order."""
    layers = [ascend_views(cache, block_size) for cache in kv_caches.values()]
    return AscendOps(layers, rope)


def _describe(cache: Any) -> str:
    if isinstance(cache, torch.Tensor):
        return f"tensor {tuple(cache.shape)}"
    if isinstance(cache, (tuple, list)):
        parts = (
            tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            for t in cache
        )
        return f"{type(cache).__name__} of {', '.join(map(str, parts))}"
    return type(cache).__name__
