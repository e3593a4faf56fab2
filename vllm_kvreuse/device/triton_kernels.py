"""The Triton kernels of :class:`~vllm_kvreuse.device.triton_ops.TritonOps`.

:func:`save_kernel` copies tokens of every layer out of a request's paged
slots into a chunk. The loads move *pieces*: windows of stored chunks, each
to its own request position with its own RoPE delta, every layer, all in one
launch: :func:`load_kernel` (no rotation, or any rotary style) and
:func:`halves_kernel` (neox RoPE over the whole head, vector reads of both
halves of every head). No kernel is decorated here: :func:`kernel_for`
compiles them for a GPU or wraps them in Triton's interpreter for CPU tensors (tests),
so one process can run both.

The piece table. A load gets an int64 ``[pieces, ROW]`` table, one row a
piece, built by :func:`piece_row`; a program finds its piece by its tile
(``program_id(0)``) among the rows' first tiles (:func:`piece_tile`). Each
window is addressed by its element offset from the launch's ``chunk_ptr``
(the first piece's window): windows live in unrelated allocations, and a
difference of addresses is as valid an offset in the flat device address
space as the layers' (Triton's interpreter reads CPU memory by address
too). Windows share their inner strides (``[.., count, H, D]`` dense), so
only the layer and K/V strides travel per piece.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import triton
import triton.language as tl

ROW = tl.constexpr(8)  # a kernel may read a global only if it is a constexpr
"""int64 fields of a piece: :func:`piece_row`'s order."""
MAX_PIECES = 64
"""Pieces one load launch takes (the width of the first-tile search)."""


def piece_row(
    first_tile: int, chunk: int, c_layer: int, c_kv: int,
    dst_start: int, count: int, table_start: int, delta: int,
) -> list[int]:  # fmt: skip
    """One row of the piece table: the piece's first tile in the launch,
    its window's element offset from ``chunk_ptr`` and its layer and K/V
    strides, its first position in the request, its tokens, where its
    request's blocks start in the launch's block table, its RoPE delta."""
    return [first_tile, chunk, c_layer, c_kv, dst_start, count, table_start, delta]


@triton.jit
def plus(a, b):
    """The sum's combine: ``tl.sum`` is a compiled-only function the
    interpreter cannot call from an explicitly interpreted kernel, where
    ``tl.reduce`` with a jit combine runs on both."""
    return a + b


def piece_tile(
    pieces_ptr, num_pieces, CHUNK_ALIGN: tl.constexpr,
    BLOCK_T: tl.constexpr, MAX_PIECES: tl.constexpr,
):  # fmt: skip
    """The piece whose tile ``program_id(0)`` is, and the tile's tokens:
    ``(token [BLOCK_T] within the piece (int32), count, chunk, c_layer, c_kv,
    dst_start, table_start, delta)`` of :func:`piece_row`. The rows' first
    tiles ascend from 0, so the piece is the number of rows starting at or
    before the tile, less one."""
    tile = tl.program_id(0)
    index = tl.arange(0, MAX_PIECES)
    present = index < num_pieces
    firsts = tl.load(pieces_ptr + index * ROW, mask=present, other=0)
    piece = tl.reduce(((firsts <= tile) & present).to(tl.int32), 0, plus) - 1
    row = pieces_ptr + piece.to(tl.int64) * ROW
    token = (tile - tl.load(row).to(tl.int32)) * BLOCK_T + tl.arange(0, BLOCK_T)
    # Loaded, so the compiler cannot see the windows' alignment; the ops
    # guarantee it (TritonOps._placed), and 16-byte accesses need it.
    chunk = tl.multiple_of(tl.load(row + 1), CHUNK_ALIGN)
    c_layer = tl.multiple_of(tl.load(row + 2), CHUNK_ALIGN)
    c_kv = tl.multiple_of(tl.load(row + 3), CHUNK_ALIGN)
    count, dst_start = tl.load(row + 5), tl.load(row + 4)
    return (token, count, chunk, c_layer, c_kv, dst_start,
            tl.load(row + 6), tl.load(row + 7))  # fmt: skip


def lane_targets(
    cache_ptr, offsets_ptr, layer, block_ids_ptr, position, token_ok,
    block_size, k_block, k_token, k_head, k_dim, v_block, v_token, v_head, v_dim,
    NUM_HEADS: tl.constexpr, LANE_DIMS: tl.constexpr, LANES: tl.constexpr,
    ALIGN: tl.constexpr,
):  # fmt: skip
    """A tile's lanes and where they go: lane ``head * LANE_DIMS + dim``
    (``LANES`` of them, a power of two), the tile's mask, and each
    ``[BLOCK_T, LANES]`` element's address in layer ``layer``'s keys and
    values, for the tokens at ``position`` (``[BLOCK_T]``, in the request
    whose views' blocks ``block_ids_ptr`` lists). Returns ``(lane, head,
    dim, mask, cache_k, cache_v)``."""
    lane = tl.arange(0, LANES)
    head = lane // LANE_DIMS
    dim = lane % LANE_DIMS
    mask = token_ok[:, None] & (lane < NUM_HEADS * LANE_DIMS)[None, :]
    position = position.to(tl.int32)  # 64-bit division is emulated: slow
    block = tl.load(block_ids_ptr + position // block_size, mask=token_ok, other=0)
    block = block.to(tl.int64)
    slot = (position % block_size).to(tl.int64)
    # The offsets are loaded, so the compiler cannot see their alignment;
    # without the hint every cache access would be a 2-byte one.
    keys = cache_ptr + tl.multiple_of(tl.load(offsets_ptr + 2 * layer), ALIGN)
    values = cache_ptr + tl.multiple_of(tl.load(offsets_ptr + 2 * layer + 1), ALIGN)
    keys += block * k_block + slot * k_token
    values += block * v_block + slot * v_token
    cache_k = keys[:, None] + (head * k_head + dim * k_dim)[None, :]
    cache_v = values[:, None] + (head * v_head + dim * v_dim)[None, :]
    return lane, head, dim, mask, cache_k, cache_v


def save_kernel(
    chunk_ptr, c_layer, c_kv, c_token, c_head, c_dim,  # [L, 2, n, H, D] chunk
    cache_ptr, offsets_ptr,  # layer 0's keys; int64 [L, 2]: each layer's K, V
    k_block, k_token, k_head, k_dim, v_block, v_token, v_head, v_dim,
    block_ids_ptr, start, count, block_size,  # the views' blocks of the request
    NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr,
    ALIGN: tl.constexpr,  # a power of two dividing every layer offset
):  # fmt: skip
    """Copies ``count`` tokens of layer ``program_id(1)`` from position
    ``start`` of the request into the chunk; program ``program_id(0)``
    takes ``BLOCK_T`` of them."""
    layer = tl.program_id(1).to(tl.int64)
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = token < count
    _, head, dim, mask, cache_k, cache_v = lane_targets(
        cache_ptr, offsets_ptr, layer, block_ids_ptr, start + token, token_ok,
        block_size, k_block, k_token, k_head, k_dim, v_block, v_token, v_head,
        v_dim, NUM_HEADS, HEAD_SIZE, BLOCK_HD, ALIGN,
    )  # fmt: skip
    row = layer * c_layer + token.to(tl.int64) * c_token
    chunk_k = chunk_ptr + row[:, None] + (head * c_head + dim * c_dim)[None, :]
    tl.store(chunk_k, tl.load(cache_k, mask=mask), mask=mask)
    tl.store(chunk_k + c_kv, tl.load(cache_v, mask=mask), mask=mask)


def load_kernel(
    chunk_ptr, pieces_ptr, num_pieces,  # the first window; int64 [pieces, ROW]
    cache_ptr, offsets_ptr,  # layer 0's keys; int64 [L, 2]: each layer's K, V
    k_block, k_token, k_head, k_dim, v_block, v_token, v_head, v_dim,
    block_ids_ptr, block_size,  # the views' blocks of every request, joined
    cos_sin_ptr,  # float32 [positions, ROTARY_DIM]: the RoPE cos | sin cache
    NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, ROTARY_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr, ROTATE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr, MAX_PIECES: tl.constexpr,
    ALIGN: tl.constexpr, CHUNK_ALIGN: tl.constexpr,
):  # fmt: skip
    """Writes ``BLOCK_T`` tokens of one piece (tile ``program_id(0)``) of
    layer ``program_id(1)`` into the paged cache, keys rotated by the
    piece's delta if ROTATE (pieces of delta 0 are copied as they are)."""
    layer = tl.program_id(1).to(tl.int64)
    token, count, chunk, c_layer, c_kv, dst_start, table, delta = piece_tile(
        pieces_ptr, num_pieces, CHUNK_ALIGN, BLOCK_T, MAX_PIECES
    )
    lane, _, dim, mask, cache_k, cache_v = lane_targets(
        cache_ptr, offsets_ptr, layer, block_ids_ptr + table, dst_start + token,
        token < count, block_size, k_block, k_token, k_head, k_dim, v_block,
        v_token, v_head, v_dim, NUM_HEADS, HEAD_SIZE, BLOCK_HD, ALIGN,
    )  # fmt: skip
    row = chunk + layer * c_layer + token.to(tl.int64) * (NUM_HEADS * HEAD_SIZE)
    chunk_k = chunk_ptr + row[:, None] + lane[None, :]
    tokens = tl.load(chunk_k, mask=mask)
    if ROTATE:
        tokens = rotated_keys(
            tokens, chunk_k, mask, dim, cos_sin_ptr, delta, ROTARY_DIM, IS_NEOX
        )
    tl.store(cache_k, tokens.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(cache_v, tl.load(chunk_k + c_kv, mask=mask), mask=mask)


def rotated_keys(
    keys, chunk_k, mask, dim, cos_sin_ptr, delta,
    ROTARY_DIM: tl.constexpr, IS_NEOX: tl.constexpr,
):  # fmt: skip
    """``keys`` (the tile :func:`load_kernel` read at ``chunk_k``; ``dim``:
    each lane's dimension) moved by ``delta`` positions, in float32; as
    they are when ``delta`` is 0.

    vLLM's RoPE (ApplyRotaryEmb.forward_static) element by element:
    out = x * cos - partner * sin in the first of each pair,
    x * cos + partner * sin in the second, with cos | sin the table's row
    ``|delta|``, the sines negated when ``delta < 0`` (``rotation_row``).
    """
    HALF: tl.constexpr = ROTARY_DIM // 2
    # Delta 0 keeps the bits: x * 1 + partner * 0 would turn -0.0 into 0.0.
    # (A limit, not `& (delta != 0)`: the interpreter's scalar & vector of
    # booleans makes an int32 mask, which its loads refuse.)
    rotated = dim < tl.where(delta != 0, ROTARY_DIM, 0)
    if IS_NEOX:
        first = dim < HALF
        partner = tl.where(first, dim + HALF, dim - HALF)
        freq = tl.where(first, dim, dim - HALF)
    else:
        first = dim % 2 == 0
        partner = tl.where(first, dim + 1, dim - 1)
        freq = dim // 2
    row = cos_sin_ptr + tl.abs(delta).to(tl.int64) * ROTARY_DIM
    cos = tl.load(row + freq, mask=rotated, other=1.0)
    sin = tl.load(row + HALF + freq, mask=rotated, other=0.0)
    sin = tl.where(delta < 0, -sin, sin)
    sin = tl.where(first, -sin, sin)
    other = tl.load(
        chunk_k + (partner - dim)[None, :], mask=mask & rotated[None, :], other=0.0
    )
    x = keys.to(tl.float32)
    turned = x * cos[None, :] + other.to(tl.float32) * sin[None, :]
    return tl.where(rotated[None, :], turned, x)


def halves_kernel(
    chunk_ptr, pieces_ptr, num_pieces,  # the first window; int64 [pieces, ROW]
    cache_ptr, offsets_ptr,  # layer 0's keys; int64 [L, 2]: each layer's K, V
    k_block, k_token, k_head, k_dim, v_block, v_token, v_head, v_dim,
    block_ids_ptr, block_size,  # the views' blocks of every request, joined
    cos_sin_ptr,  # float32 [positions, 2 * HALF]: the RoPE cos | sin cache
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, MAX_PIECES: tl.constexpr,
    ALIGN: tl.constexpr, CHUNK_ALIGN: tl.constexpr,
):  # fmt: skip
    """A load rotating neox RoPE over the whole head (most models), as
    :func:`load_kernel` does with ROTATE, but each lane holds a pair of
    dimensions ``(d, d + HALF)`` of one head: both halves are read as
    contiguous runs (vector loads), where :func:`rotated_keys` gathers each
    key's partner element by element. The same arithmetic, in the same
    order: the same bits."""
    layer = tl.program_id(1).to(tl.int64)
    token, count, chunk, c_layer, c_kv, dst_start, table, delta = piece_tile(
        pieces_ptr, num_pieces, CHUNK_ALIGN, BLOCK_T, MAX_PIECES
    )
    _, head, dim, mask, cache_k, cache_v = lane_targets(
        cache_ptr, offsets_ptr, layer, block_ids_ptr + table, dst_start + token,
        token < count, block_size, k_block, k_token, k_head, k_dim, v_block,
        v_token, v_head, v_dim, NUM_HEADS, HALF, BLOCK_P, ALIGN,
    )  # fmt: skip
    row = chunk + layer * c_layer + token.to(tl.int64) * (NUM_HEADS * 2 * HALF)
    chunk_k = chunk_ptr + row[:, None] + (head * 2 * HALF + dim)[None, :]
    chunk_v = chunk_k + c_kv

    angles = cos_sin_ptr + tl.abs(delta).to(tl.int64) * (2 * HALF)
    cos = tl.load(angles + dim)[None, :]
    sin = tl.load(angles + HALF + dim)[None, :]
    sin = tl.where(delta < 0, -sin, sin)  # rotation_row's backward move
    first = tl.load(chunk_k, mask=mask).to(tl.float32)
    second = tl.load(chunk_k + HALF, mask=mask).to(tl.float32)
    moved = delta != 0  # delta 0 keeps the bits (-0.0 stays -0.0)
    new_first = tl.where(moved, first * cos + second * -sin, first)
    new_second = tl.where(moved, second * cos + first * sin, second)
    element = cache_ptr.dtype.element_ty
    tl.store(cache_k, new_first.to(element), mask=mask)
    tl.store(cache_k + HALF * k_dim, new_second.to(element), mask=mask)
    tl.store(cache_v, tl.load(chunk_v, mask=mask), mask=mask)
    tl.store(cache_v + HALF * v_dim, tl.load(chunk_v + HALF, mask=mask), mask=mask)


KERNELS = {"save": save_kernel, "load": load_kernel, "halves": halves_kernel}
DEVICE_FUNCTIONS = (piece_tile, lane_targets, rotated_keys)
"""What the kernels call: compiled or interpreted along with them."""
UNSPECIALISED = {"save": ["start", "count"], "load": ["num_pieces"],
                 "halves": ["num_pieces"]}  # fmt: skip
"""Arguments that vary per launch: specialising on them (1, multiples of
16) would compile new variants during requests."""


@functools.cache
def kernel_for(device_type: str, name: str) -> Any:
    """The kernel ``name`` (of :data:`KERNELS`) compiled for a GPU, or run
    by Triton's interpreter on CPU."""
    if device_type == "cpu":
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(with_device_functions(name, InterpretedFunction))
    kernel = with_device_functions(name, triton.jit)
    return triton.jit(kernel, do_not_specialize=UNSPECIALISED[name])


def with_device_functions(name: str, wrap: Callable[[Any], Any]) -> Any:
    """The kernel ``name`` calling each of :data:`DEVICE_FUNCTIONS` as
    ``wrap`` (``triton.jit``, or the interpreter's) makes it. None is
    decorated in this module, so one process can run both: a kernel calls
    only device functions of its own kind."""
    original = KERNELS[name]
    scope = dict(original.__globals__)
    scope.update({f.__name__: wrap(f) for f in DEVICE_FUNCTIONS})
    kernel = types.FunctionType(original.__code__, scope, original.__name__)
    # Triton reads which parameters are constexpr from the annotations, which
    # a new function does not inherit: without them the compiler sees
    # BLOCK_T as a runtime value and refuses tl.arange (the interpreter
    # does not mind, so only a GPU showed it).
    kernel.__annotations__ = dict(original.__annotations__)
    kernel.__qualname__ = original.__qualname__
    kernel.__module__ = original.__module__
    return kernel
