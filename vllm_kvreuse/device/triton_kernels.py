"""The Triton kernels of :class:`~vllm_kvreuse.device.triton_ops.TritonOps`.

:func:`move_kernel` moves tokens of every layer between a stored chunk and
a request's paged slots (save, load, load with RoPE rotation, any rotary
style); :func:`halves_kernel` is the rotating load for neox RoPE over the
whole head, with vector reads of both halves of every head. Neither is
decorated here: :func:`kernel_for` compiles them for a GPU or wraps them in
Triton's interpreter for CPU tensors (tests), so one process can run both.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import triton
import triton.language as tl


def move_kernel(
    chunk_ptr, c_layer, c_kv, c_token, c_head, c_dim,  # [L, 2, n, H, D] window
    cache_ptr, offsets_ptr,  # layer 0's keys; int64 [L, 2]: each layer's K, V
    k_block, k_token, k_head, k_dim, v_block, v_token, v_head, v_dim,
    block_ids_ptr, start, count, block_size,  # the views' blocks of the request
    cos_sin_ptr,  # float32 [rotary_dim]: cos | sin of the delta
    NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, ROTARY_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr, ROTATE: tl.constexpr, SAVE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr,
    ALIGN: tl.constexpr,  # a power of two dividing every layer offset
):  # fmt: skip
    """Moves ``count`` tokens of layer ``program_id(1)`` between the chunk
    and the paged cache, from position ``start`` of the request; program
    ``program_id(0)`` takes ``BLOCK_T`` of them.

    SAVE: cache -> chunk. Otherwise chunk -> cache, keys rotated if ROTATE.
    """
    layer = tl.program_id(1).to(tl.int64)
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    lane = tl.arange(0, BLOCK_HD)  # head * HEAD_SIZE + dim
    head = lane // HEAD_SIZE
    dim = lane % HEAD_SIZE
    token_ok = token < count
    mask = token_ok[:, None] & (lane < NUM_HEADS * HEAD_SIZE)[None, :]

    position = start + token
    block = tl.load(block_ids_ptr + position // block_size, mask=token_ok, other=0)
    block = block.to(tl.int64)
    slot = (position % block_size).to(tl.int64)
    # The offsets are loaded, so the compiler cannot see their alignment;
    # without the hint every cache access would be a 2-byte one.
    keys_base = cache_ptr + tl.multiple_of(tl.load(offsets_ptr + 2 * layer), ALIGN)
    values_base = cache_ptr + tl.multiple_of(
        tl.load(offsets_ptr + 2 * layer + 1), ALIGN
    )
    cache_k = (
        keys_base
        + (block * k_block + slot * k_token)[:, None]
        + (head * k_head + dim * k_dim)[None, :]
    )
    cache_v = (
        values_base
        + (block * v_block + slot * v_token)[:, None]
        + (head * v_head + dim * v_dim)[None, :]
    )
    row = layer * c_layer + token.to(tl.int64) * c_token
    chunk_k = chunk_ptr + row[:, None] + (head * c_head + dim * c_dim)[None, :]
    chunk_v = chunk_k + c_kv

    if SAVE:
        tl.store(chunk_k, tl.load(cache_k, mask=mask), mask=mask)
        tl.store(chunk_v, tl.load(cache_v, mask=mask), mask=mask)
    else:
        keys = tl.load(chunk_k, mask=mask)
        if ROTATE:
            keys = rotated_keys(
                keys, chunk_k, mask, dim, c_dim, cos_sin_ptr, ROTARY_DIM, IS_NEOX
            )
        tl.store(cache_k, keys.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(cache_v, tl.load(chunk_v, mask=mask), mask=mask)


def rotated_keys(
    keys, chunk_k, mask, dim, c_dim, cos_sin_ptr,
    ROTARY_DIM: tl.constexpr, IS_NEOX: tl.constexpr,
):  # fmt: skip
    """``keys`` (the tile :func:`move_kernel` read at ``chunk_k``; ``dim``:
    each lane's dimension) rotated by the delta, in float32.

    vLLM's RoPE (ApplyRotaryEmb.forward_static) element by element:
    out = x * cos - partner * sin in the first of each pair,
    x * cos + partner * sin in the second.
    """
    HALF: tl.constexpr = ROTARY_DIM // 2
    rotated = dim < ROTARY_DIM
    if IS_NEOX:
        first = dim < HALF
        partner = tl.where(first, dim + HALF, dim - HALF)
        freq = tl.where(first, dim, dim - HALF)
    else:
        first = dim % 2 == 0
        partner = tl.where(first, dim + 1, dim - 1)
        freq = dim // 2
    cos = tl.load(cos_sin_ptr + freq, mask=rotated, other=1.0)
    sin = tl.load(cos_sin_ptr + HALF + freq, mask=rotated, other=0.0)
    sin = tl.where(first, -sin, sin)
    other = tl.load(
        chunk_k + ((partner - dim) * c_dim)[None, :],
        mask=mask & rotated[None, :],
        other=0.0,
    )
    x = keys.to(tl.float32)
    turned = x * cos[None, :] + other.to(tl.float32) * sin[None, :]
    return tl.where(rotated[None, :], turned, x)


DEVICE_FUNCTIONS = (rotated_keys,)
"""What :func:`move_kernel` calls: compiled or interpreted along with it."""


@functools.cache
def kernel_for(device_type: str, halves: bool = False) -> Any:
    """:func:`move_kernel` (or :func:`halves_kernel`) compiled for a GPU, or
    run by Triton's interpreter on CPU."""
    if device_type == "cpu":
        from triton.runtime.interpreter import InterpretedFunction

        if halves:
            return InterpretedFunction(halves_kernel)
        return InterpretedFunction(with_device_functions(InterpretedFunction))
    kernel = halves_kernel if halves else with_device_functions(triton.jit)
    return triton.jit(kernel, do_not_specialize=["start", "count"])


def with_device_functions(wrap: Callable[[Any], Any]) -> Any:
    """:func:`move_kernel` calling each of :data:`DEVICE_FUNCTIONS` as
    ``wrap`` (``triton.jit``, or the interpreter's) makes it. Neither is
    decorated in this module, so one process can run both: a kernel calls
    only device functions of its own kind."""
    scope = dict(move_kernel.__globals__)
    scope.update({f.__name__: wrap(f) for f in DEVICE_FUNCTIONS})
    kernel = types.FunctionType(move_kernel.__code__, scope, move_kernel.__name__)
    # Triton reads which parameters are constexpr from the annotations, which
    # a new function does not inherit: without them the compiler sees
    # BLOCK_T as a runtime value and refuses tl.arange (the interpreter
    # does not mind, so only a GPU showed it).
    kernel.__annotations__ = dict(move_kernel.__annotations__)
    kernel.__qualname__ = move_kernel.__qualname__
    kernel.__module__ = move_kernel.__module__
    return kernel


def halves_kernel(
    chunk_ptr, c_layer, c_kv, c_token, c_head, c_dim,  # [L, 2, n, H, D] window
    cache_ptr, offsets_ptr,  # layer 0's keys; int64 [L, 2]: each layer's K, V
    k_block, k_token, k_head, k_dim, v_block, v_token, v_head, v_dim,
    block_ids_ptr, start, count, block_size,  # the views' blocks of the request
    cos_sin_ptr,  # float32 [HEAD_SIZE]: cos | sin of the delta
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, ALIGN: tl.constexpr,
):  # fmt: skip
    """A load rotating neox RoPE over the whole head (most models), as
    :func:`move_kernel` does with ROTATE, but each lane holds a pair of
    dimensions ``(d, d + HALF)`` of one head: both halves are read as
    contiguous runs (vector loads), where :func:`rotated_keys` gathers each
    key's partner element by element. The same arithmetic, in the same
    order: the same bits."""
    layer = tl.program_id(1).to(tl.int64)
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    lane = tl.arange(0, BLOCK_P)  # head * HALF + d
    head = lane // HALF
    dim = lane % HALF
    token_ok = token < count
    mask = token_ok[:, None] & (lane < NUM_HEADS * HALF)[None, :]

    position = start + token
    block = tl.load(block_ids_ptr + position // block_size, mask=token_ok, other=0)
    block = block.to(tl.int64)
    slot = (position % block_size).to(tl.int64)
    keys_base = cache_ptr + tl.multiple_of(tl.load(offsets_ptr + 2 * layer), ALIGN)
    values_base = cache_ptr + tl.multiple_of(
        tl.load(offsets_ptr + 2 * layer + 1), ALIGN
    )
    cache_k = (
        keys_base
        + (block * k_block + slot * k_token)[:, None]
        + (head * k_head + dim * k_dim)[None, :]
    )
    cache_v = (
        values_base
        + (block * v_block + slot * v_token)[:, None]
        + (head * v_head + dim * v_dim)[None, :]
    )
    row = layer * c_layer + token.to(tl.int64) * c_token
    chunk_k = chunk_ptr + row[:, None] + (head * c_head + dim * c_dim)[None, :]
    chunk_v = chunk_k + c_kv

    cos = tl.load(cos_sin_ptr + dim)[None, :]
    sin = tl.load(cos_sin_ptr + HALF + dim)[None, :]
    first = tl.load(chunk_k, mask=mask).to(tl.float32)
    second = tl.load(chunk_k + HALF * c_dim, mask=mask).to(tl.float32)
    element = cache_ptr.dtype.element_ty
    tl.store(cache_k, (first * cos + second * -sin).to(element), mask=mask)
    tl.store(
        cache_k + HALF * k_dim, (second * cos + first * sin).to(element), mask=mask
    )
    tl.store(cache_v, tl.load(chunk_v, mask=mask), mask=mask)
    tl.store(
        cache_v + HALF * v_dim, tl.load(chunk_v + HALF * c_dim, mask=mask), mask=mask
    )
