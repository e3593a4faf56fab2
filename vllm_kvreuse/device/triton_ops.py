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

import math
from collections.abc import Sequence
from typing import Any

import torch
import triton

from vllm_kvreuse.device.base import (
    DeviceOps,
    PagedKV,
    UnsupportedKVLayout,
    rotation_row,
)
from vllm_kvreuse.device.triton_kernels import kernel_for

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
    HALVES = True
    """Rotating loads of neox RoPE over the whole head use
    :func:`~.triton_kernels.halves_kernel` (vector reads of both halves)."""

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
        self._halves = None
        if (
            rope is not None
            and rope.is_neox_style
            and rope.rotary_dim == self.head_size
        ):
            self._halves = kernel_for(self.device.type, halves=True)

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
            kernel, grid, args, options = self._arguments(
                table, 0, chunk, 1, delta, save
            )
            kernel.warmup(*args, grid=grid, **options)

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
        kernel, grid, args, options = self._arguments(
            table, start, chunk, count, delta, save
        )
        kernel[grid](*args, **options)

    def _arguments(
        self,
        table: torch.Tensor,
        start: int,
        chunk: torch.Tensor,
        count: int,
        delta: int,
        save: bool,
    ) -> tuple[Any, tuple[int, int], tuple[Any, ...], dict[str, Any]]:
        """The kernel, grid, arguments and compile options of one launch."""
        rotate = bool(delta) and not save
        # Without rotation the kernel never reads cos/sin: any pointer will do.
        cos_sin = self._cos_sin_row(delta) if rotate else self._offsets
        keys, values = self.layers[0].keys, self.layers[0].values
        args = (
            chunk, *chunk.stride(),
            keys, self._offsets, *keys.stride(), *values.stride(),
            table, start, count, self.kernel_block_size, cos_sin,
        )  # fmt: skip
        # Separate multiply and add, as torch's eager ops round them: the
        # same bits as TorchOps, at no cost in a memory-bound kernel.
        common = dict(
            ALIGN=self._align, num_warps=self.NUM_WARPS, enable_fp_fusion=False
        )
        if rotate and self._halves is not None and self.HALVES:
            half = self.head_size // 2
            lanes = triton.next_power_of_2(self.num_heads * half)
            block_t = max(1, self.TILE // (2 * lanes))
            grid = (triton.cdiv(count, block_t), len(self.layers))
            options = dict(NUM_HEADS=self.num_heads, HALF=half, BLOCK_T=block_t,
                           BLOCK_P=lanes, **common)  # fmt: skip
            return self._halves, grid, args, options
        block_t, block_hd = self.tile
        grid = (triton.cdiv(count, block_t), len(self.layers))
        options = dict(
            NUM_HEADS=self.num_heads,
            HEAD_SIZE=self.head_size,
            ROTARY_DIM=self.rope.rotary_dim if rotate else self.head_size,
            IS_NEOX=self.rope.is_neox_style if rotate else True,
            ROTATE=rotate,
            SAVE=save,
            BLOCK_T=block_t,
            BLOCK_HD=block_hd,
            **common,
        )
        return self._kernel, grid, args, options

    def _cos_sin_row(self, delta: int) -> torch.Tensor:
        assert self._cos_sin is not None and self.rope is not None, (
            "loading at another position needs RoPE"
        )
        return rotation_row(self._cos_sin, delta)
