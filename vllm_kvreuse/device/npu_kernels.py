"""The Ascend kernels the NPU ops call, each beside its torch equivalent.

Every function here takes the same tensors on any device: on an NPU (with
``torch_npu`` importable) it calls the kernel vllm-ascend itself uses for
that job; anywhere else it runs the torch statement that defines what the
kernel computes. The layout and slot logic in :mod:`vllm_kvreuse.device.npu`
is therefore the same code on CPU (tested here) and on an NPU.

Shapes: ``key_cache``/``value_cache`` are one layer's ND caches
``[num_blocks, block_size, H, D]`` (contiguous); a slot is
``block * block_size + offset``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from vllm_kvreuse.device import torch_ops
from vllm_kvreuse.device.base import Rope

try:  # present only on an Ascend machine, next to CANN
    import torch_npu
except ImportError:
    torch_npu = None

ACL_FORMAT_FRACTAL_NZ = 29
"""torch_npu's id for the FRACTAL_NZ storage format (310P caches, C8)."""


def on_npu(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives on an NPU, so the kernels apply."""
    return torch_npu is not None and tensor.device.type == "npu"


def storage_format(tensor: torch.Tensor) -> int | None:
    """torch_npu's storage format id of ``tensor``; None off an NPU (plain
    strided memory)."""
    return torch_npu.get_npu_format(tensor) if on_npu(tensor) else None


def scatter_slots(
    keys: torch.Tensor,
    values: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Writes token ``i`` of ``keys``/``values`` (``[n, H, D]``, the caches'
    dtype) into slot ``slots[i]`` (int32) of the caches.

    Mutates exactly those slots. NPU: ``torch_npu.npu_scatter_pa_kv_cache``
    in "Norm" (ND) mode, as vllm-ascend's attention writes KV.
    """
    if on_npu(key_cache):
        torch_npu.npu_scatter_pa_kv_cache(
            key=keys.contiguous(),
            value=values.contiguous(),
            key_cache=key_cache,
            value_cache=value_cache,
            slot_mapping=slots.contiguous(),
            cache_mode="Norm",
        )
        return
    index = slots.long()
    # view(), not flatten(): a cache that is not one block-major run of
    # memory must fail here rather than be written through a copy
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, index, keys)
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, index, values)


def gather_sequence(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the first ``num_tokens`` tokens of the sequence whose blocks
    are ``block_table`` (``[1, num_table_blocks]``, int32): ``[num_tokens, H,
    D]`` keys and values in the caches' dtype. Token ``j`` is slot
    ``j % block_size`` of block ``block_table[0, j // block_size]``.

    Mutates nothing. NPU: ``torch_npu.npu_gather_pa_kv_cache`` with a zero
    sequence offset (the call vllm-ascend's Mooncake connector makes).
    """
    if on_npu(key_cache):
        device = key_cache.device
        keys = key_cache.new_empty((num_tokens, *key_cache.shape[2:]))
        values = value_cache.new_empty((num_tokens, *value_cache.shape[2:]))
        torch_npu.npu_gather_pa_kv_cache(
            key_cache,
            value_cache,
            block_table,
            torch.tensor([num_tokens], dtype=torch.int32, device=device),
            seq_offset=torch.zeros(1, dtype=torch.int32, device=device),
            key=keys,
            value=values,
        )
        return keys, values
    positions = torch.arange(num_tokens, device=block_table.device)
    block_size = key_cache.shape[1]
    blocks = block_table[0].long()[positions // block_size]
    offsets = positions % block_size
    return key_cache[blocks, offsets], value_cache[blocks, offsets]


def rerotate_keys(keys: torch.Tensor, delta: int, rope: Rope) -> torch.Tensor:
    """Keys ``[..., H, D]`` moved by ``delta`` positions, in float32; mutates
    nothing.

    NPU with Triton: vllm-ascend's single-input RoPE kernel
    (``rope_forward_triton_siso``), every key at position ``delta`` of a
    one-row cos/sin table. Otherwise the torch ops' rotation, which calls
    the platform's ``ApplyRotaryEmb`` (on Ascend vllm-ascend's, that is
    ``npu_rotary_mul``).
    """
    kernel = _triton_rope() if on_npu(keys) else None
    if kernel is None:
        return torch_ops.rerotate_keys(keys, delta, rope)
    # a copy: the kernel rotates in place, and ``keys`` may be a view of the
    # stored chunk
    rows = keys.to(torch.float32, copy=True).reshape(-1, *keys.shape[-2:])
    rows = rows.contiguous()
    row = rope.row(delta).to(keys.device)
    positions = torch.zeros(rows.shape[0], dtype=torch.long, device=keys.device)
    rotated = kernel(
        rows,
        cos_sin_cache=row,
        positions=positions,
        rope_dim=rope.rotary_dim,
        is_neox_style=rope.is_neox_style,
    )
    return rotated.view(keys.shape)


@functools.cache
def _triton_rope() -> Any:
    """vllm-ascend's ``rope_forward_triton_siso`` (rotates one tensor in
    place and returns it), or None where Triton-Ascend or the function is
    missing (older vllm-ascend, no triton-ascend)."""
    try:
        from vllm.triton_utils import HAS_TRITON
        from vllm_ascend.ops.triton.rope import rope_forward_triton_siso
    except ImportError:
        return None
    return rope_forward_triton_siso if HAS_TRITON else None
