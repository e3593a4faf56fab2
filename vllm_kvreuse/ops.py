"""Device ops on KV tensors, the one place a device port swaps.

Everything that reads or writes paged KV memory, or rotates keys, lives here
and is written in plain torch, so it runs unchanged on CPU and CUDA. An
Ascend port replaces these functions (same signatures) with NPU kernels; the
callers (:mod:`vllm_kvreuse.chunk_cache.connector`) never touch a KV tensor
themselves.

Conventions:
- A token's KV is ``[num_kv_heads, head_size]`` per layer, keys and values
  apart; a run of ``n`` tokens is ``[n, num_kv_heads, head_size]``.
- A slot is ``block_id * block_size + offset`` (vLLM's slot mapping).
- Keys in vLLM's cache are stored after RoPE; values carry no position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from vllm.model_executor.layers.rotary_embedding.common import ApplyRotaryEmb


@dataclass(frozen=True, slots=True)
class PagedKV:
    """Token-addressable views of one layer's paged KV cache.

    ``keys`` and ``values`` are ``[num_blocks, block_size, num_kv_heads,
    head_size]`` views sharing the cache's storage: writing them writes the
    cache. Build with :func:`paged_kv`.
    """

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.keys.shape[1]


class UnsupportedKVLayout(ValueError):
    """The attention backend stores KV in a layout these ops cannot address."""


def paged_kv(
    cache: torch.Tensor, backend_name: str, block_size: int, cpu_isa: str | None = None
) -> PagedKV:
    """Views of ``cache`` (one layer, as vLLM allocated it for ``backend_name``).

    Known layouts:
    - ``CPU_ATTN`` with the ``vec`` kernels (x86 without AMX, or float32 /
      float16): ``[num_blocks, H, block_size, 2 * D]`` where each (block,
      head) holds its keys transposed (``[D, block_size]``), then its values
      row by row (``[block_size, D]``).
    - CUDA backends with vLLM's default layout: ``[2, num_blocks, block_size,
      H, D]``, keys first.

    Anything else (e.g. the AMX kernels' VNNI-packed bfloat16) raises
    :class:`UnsupportedKVLayout`.
    """
    if backend_name == "CPU_ATTN":
        if cpu_isa != "vec":
            raise UnsupportedKVLayout(
                f"the CPU attention kernels {cpu_isa!r} pack KV in a layout the "
                "chunk cache does not address; use dtype float32 or float16"
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
    if cache.dim() == 5 and cache.shape[0] == 2 and cache.shape[2] == block_size:
        return PagedKV(keys=cache[0], values=cache[1])
    raise UnsupportedKVLayout(
        f"KV cache layout of attention backend {backend_name} "
        f"(shape {tuple(cache.shape)}) is not supported by the chunk cache"
    )


def slots_of(
    block_ids: torch.Tensor, start: int, count: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block index, offset) tensors of ``count`` tokens from position ``start``.

    ``block_ids`` lists a request's blocks in order; position ``p`` lives in
    ``block_ids[p // block_size]`` at offset ``p % block_size``.
    """
    positions = torch.arange(start, start + count, device=block_ids.device)
    return block_ids[positions // block_size], positions % block_size


def read_tokens(
    kv: PagedKV, blocks: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the keys and values at the given slots: ``[n, H, D]`` each."""
    return kv.keys[blocks, offsets], kv.values[blocks, offsets]


def write_tokens(
    kv: PagedKV,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """Writes ``[n, H, D]`` keys and values into the given slots."""
    kv.keys[blocks, offsets] = keys.to(kv.keys.dtype)
    kv.values[blocks, offsets] = values.to(kv.values.dtype)


@dataclass(frozen=True, slots=True)
class Rope:
    """The model's rotary embedding, as the data a rotation needs.

    Angles are linear in the position (``pos * inv_freq``), so rotating a key
    already rotated for position ``v`` by ``delta`` gives the key for position
    ``v + delta``. :mod:`vllm_kvreuse.chunk_cache.rope` refuses models for
    which that does not hold.
    """

    cos_sin_cache: torch.Tensor  # [max_position, rotary_dim], float32
    head_size: int
    rotary_dim: int
    is_neox_style: bool


def rerotate_keys(keys: torch.Tensor, delta: int, rope: Rope) -> torch.Tensor:
    """Keys ``[..., H, D]`` moved by ``delta`` positions, in float32.

    One position for the whole tensor, so a chunk's keys of every layer
    rotate in one pass. The arithmetic is vLLM's own
    (``ApplyRotaryEmb.forward_static``) with the model's cos/sin table.
    """
    cos, sin = rope.cos_sin_cache[delta].to(keys.device).chunk(2)
    x = keys.to(torch.float32)
    rotated = ApplyRotaryEmb.forward_static(
        x[..., : rope.rotary_dim], cos[None], sin[None], rope.is_neox_style
    )
    return torch.cat((rotated, x[..., rope.rotary_dim :]), dim=-1)


def load_chunk(
    layers: Sequence[PagedKV],
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    delta: int,
    rope: Rope,
) -> None:
    """Writes a stored chunk (``[layers, n, H, D]`` keys and values) into a
    request's slots in every layer, keys moved by ``delta`` positions.

    On an accelerator all layers' keys rotate in one pass (the cost there is
    kernel launches); on CPU layer by layer, which keeps each layer's keys in
    cache (measured 2.3x faster for a 24-layer model than one pass).
    """
    device = layers[0].keys.device
    if delta and device.type != "cpu":
        keys = rerotate_keys(keys.to(device), delta, rope)
    for layer, kv in enumerate(layers):
        layer_keys = keys[layer]
        if delta and device.type == "cpu":
            layer_keys = rerotate_keys(layer_keys, delta, rope)
        write_tokens(kv, blocks, offsets, layer_keys, values[layer].to(device))
