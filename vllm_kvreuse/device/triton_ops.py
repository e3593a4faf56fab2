"""The Triton implementation of :class:`DeviceOps`: one launch per chunk move.

A chunk load is memory-bound: its floor is one read of the stored chunk and
one write of its bytes into the request's paged slots. :func:`move_kernel`
does that for every layer in one launch. Each program takes ``BLOCK_T``
tokens of one layer (every head, keys and values), rotates the keys by the
chunk's position delta in registers (float32, the model's RoPE, neox or
GPT-J, partial rotary dims) and stores them straight into the slots. A save
is the same walk backwards, without rotation.

Addressing. Layer ``l``'s keys and values start at element offsets
``offsets[l]`` from one base pointer, layer 0's keys. vLLM puts all layers in
one allocation (``allocate_kv_cache``), so these are offsets inside it; for
separately allocated layers on one GPU they are address differences, which
the flat device address space makes just as valid. Every layer must share
dtype, shape and strides (one KV cache spec), so one set of strides serves
all; :func:`unsupported_reason` says when that does not hold, and
:func:`vllm_kvreuse.device.build_ops` then keeps :class:`TorchOps`.

On CPU tensors the same kernel runs in Triton's interpreter (for tests): the
interpreted variant is built explicitly, so nothing depends on
``TRITON_INTERPRET`` being set before import.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from vllm_kvreuse.device.base import (
    DeviceOps,
    PagedKV,
    UnsupportedKVLayout,
    rotation_row,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
def kernel_for(device_type: str) -> Any:
    """The kernel compiled for a GPU, or run by Triton's interpreter on CPU."""
    if device_type == "cpu":
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(with_device_functions(InterpretedFunction))
    kernel = with_device_functions(triton.jit)
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


def unsupported_reason(layers: Sequence[PagedKV]) -> str | None:
    """Why one set of strides cannot address every layer, or None."""
    first = layers[0]
    if type(first) is not PagedKV:  # the kernel addresses plain strided views
        return f"{type(first).__name__} layers"
    if first.keys.dtype not in DTYPES:
        return f"KV dtype {first.keys.dtype}"
    element = first.keys.element_size()
    for layer, kv in enumerate(layers):
        for name, view, reference in (
            ("keys", kv.keys, first.keys),
            ("values", kv.values, first.values),
        ):
            if (view.dtype, view.device, view.shape, view.stride()) != (
                reference.dtype,
                reference.device,
                reference.shape,
                reference.stride(),
            ):
                return f"layer {layer}'s {name} differ from layer 0's in layout"
            if (view.data_ptr() - first.keys.data_ptr()) % element:
                return f"layer {layer}'s {name} are not element-aligned with layer 0's"
    return None


class TritonOps(DeviceOps):
    """One fused kernel launch per save or load, all layers at once.

    Every launch uses one of three compiled variants (save, load, load with
    rotation): the tile is fixed per cache shape and ``start`` and
    ``count`` are not specialised on, so :meth:`warm_up` compiles all there
    are when the engine starts, never during a request.
    """

    name = "triton"
    TILE = 4096
    """Elements (tokens x heads x head size) one program moves per side."""
    NUM_WARPS = 4

    def _prepare(self) -> None:
        if reason := unsupported_reason(self.layers):
            raise UnsupportedKVLayout(f"the Triton chunk ops cannot address: {reason}")
        base = self.layers[0].keys
        element = base.element_size()
        offsets = [
            (view.data_ptr() - base.data_ptr()) // element
            for kv in self.layers
            for view in (kv.keys, kv.values)
        ]
        # [L, 2]: where each layer's keys and values start, from layer 0's keys.
        self._offsets = torch.tensor(offsets, dtype=torch.int64, device=self.device)
        # Alignment the compiler may assume of every layer offset (elements).
        self._align = math.gcd(16, *offsets)
        _, _, self.num_heads, self.head_size = base.shape
        self._cos_sin = None
        if (rope := self.rope) is not None:
            assert rope.head_size == self.head_size, "RoPE and KV head sizes differ"
            self._cos_sin = rope.cos_sin_cache.to(self.device, torch.float32)
        self._kernel = kernel_for(self.device.type)

    @property
    def tile(self) -> tuple[int, int]:
        """(tokens, lanes) one program moves: every head of ``tokens``."""
        lanes = triton.next_power_of_2(self.num_heads * self.head_size)
        return max(1, self.TILE // lanes), lanes

    def warm_up(self) -> None:
        """Compiles the kernel's variants now (a GPU compiles at first use;
        the interpreter needs nothing)."""
        if self.device.type == "cpu":
            return
        table = torch.zeros(1, dtype=torch.int64, device=self.device)
        variants = [(0, True), (0, False)] + ([(1, False)] if self.rope else [])
        for delta, save in variants:  # (delta, save): save, load, rotating load
            chunk = self._chunk(1)
            grid, args, options = self._arguments(table, 0, chunk, 1, delta, save)
            self._kernel.warmup(*args, grid=grid, **options)

    def save_chunk(
        self, block_ids: torch.Tensor, start: int, count: int
    ) -> torch.Tensor:
        chunk = self._chunk(count)
        self._launch(block_ids, start, chunk, count, delta=0, save=True)
        return chunk

    def write_window(
        self, block_ids: torch.Tensor, start: int, window: torch.Tensor, delta: int
    ) -> None:
        window = window.to(self.layers[0].keys.dtype)  # the kernel's one dtype
        self._launch(block_ids, start, window, window.shape[2], delta, save=False)

    def _chunk(self, count: int) -> torch.Tensor:
        shape = (len(self.layers), 2, count, self.num_heads, self.head_size)
        return torch.empty(shape, dtype=self.layers[0].keys.dtype, device=self.device)

    def _launch(
        self,
        block_ids: torch.Tensor,
        start: int,
        chunk: torch.Tensor,
        count: int,
        delta: int,
        save: bool,
    ) -> None:
        expected = (len(self.layers), 2, count, self.num_heads, self.head_size)
        assert chunk.shape == expected, (
            f"chunk {tuple(chunk.shape)} does not match the cache's {expected}"
        )
        if count == 0:
            return
        table = self.kernel_block_ids(block_ids.to(self.device))
        assert start + count <= table.numel() * self.kernel_block_size, (
            "the chunk runs past the request's block table"
        )
        grid, args, options = self._arguments(table, start, chunk, count, delta, save)
        self._kernel[grid](*args, **options)

    def _arguments(
        self,
        table: torch.Tensor,
        start: int,
        chunk: torch.Tensor,
        count: int,
        delta: int,
        save: bool,
    ) -> tuple[tuple[int, int], tuple[Any, ...], dict[str, Any]]:
        """The grid, arguments and compile options of one launch."""
        rotate = bool(delta) and not save
        # Without rotation the kernel never reads cos/sin: any pointer will do.
        cos_sin = self._cos_sin_row(delta) if rotate else self._offsets
        block_t, block_hd = self.tile
        grid = (triton.cdiv(count, block_t), len(self.layers))
        keys, values = self.layers[0].keys, self.layers[0].values
        args = (
            chunk, *chunk.stride(),
            keys, self._offsets, *keys.stride(), *values.stride(),
            table, start, count, self.kernel_block_size, cos_sin,
        )  # fmt: skip
        options = dict(
            NUM_HEADS=self.num_heads,
            HEAD_SIZE=self.head_size,
            ROTARY_DIM=self.rope.rotary_dim if rotate else self.head_size,
            IS_NEOX=self.rope.is_neox_style if rotate else True,
            ROTATE=rotate,
            SAVE=save,
            BLOCK_T=block_t,
            BLOCK_HD=block_hd,
            ALIGN=self._align,
            num_warps=self.NUM_WARPS,
            # Separate multiply and add, as torch's eager ops round them:
            # the same bits as TorchOps, at no cost in a memory-bound kernel.
            enable_fp_fusion=False,
        )
        return grid, args, options

    def _cos_sin_row(self, delta: int) -> torch.Tensor:
        assert self._cos_sin is not None and self.rope is not None, (
            "loading at another position needs RoPE"
        )
        return rotation_row(self._cos_sin, delta)
