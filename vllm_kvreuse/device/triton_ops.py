"""The Triton implementation of :class:`DeviceOps`: one launch per save, and
one per step's loads.

A chunk load is memory-bound: its floor is one read of the stored chunk and
one write of its bytes into the request's paged slots. Each load launch
(:func:`~.triton_kernels.load_kernel`) moves every piece a step loads (up
to ``MAX_PIECES``; windows of several chunks, for several requests), every
layer: each program takes ``BLOCK_T`` tokens of one piece and one layer
(every head, keys and values), rotates the keys by the piece's position
delta in registers (float32, the model's RoPE, neox or GPT-J, partial
rotary dims) and stores them straight into the slots. A launch costs ~90 us
on an H200 whatever it moves, so a RAG request's 4-8 chunks in one launch
save 3-7 of them. A save (:func:`~.triton_kernels.save_kernel`) is one
chunk's walk backwards, without rotation.

Addressing. Layer ``l``'s keys and values start at element offsets
``offsets[l]`` from one base pointer, layer 0's keys. vLLM puts all layers in
one allocation (``allocate_kv_cache``), so these are offsets inside it; for
separately allocated layers on one GPU they are address differences, which
the flat device address space makes just as valid. Every layer must share
dtype, shape and strides (one KV cache spec), so one set of strides serves
all; :func:`unsupported_reason` says when that does not hold, and
:func:`vllm_kvreuse.device.build_ops` then keeps :class:`TorchOps`. The
windows a load launch reads are addressed the same way, from its first
window (:mod:`~.triton_kernels`, the piece table).

On CPU tensors the same kernel runs in Triton's interpreter (for tests): the
interpreted variant is built explicitly, so nothing depends on
``TRITON_INTERPRET`` being set before import.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch
import triton

from vllm_kvreuse.device.base import (
    ChunkLoad,
    ChunkPiece,
    DeviceOps,
    PagedKV,
    UnsupportedKVLayout,
)
from vllm_kvreuse.device.triton_kernels import MAX_PIECES, kernel_for, piece_row

Launch = tuple[Any, tuple[int, int], tuple[Any, ...], dict[str, Any]]
"""A kernel, its grid, arguments and compile options."""

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
    """One fused kernel launch per save, and per step's loads, all layers at
    once.

    Every launch uses one of four compiled variants (save, load, rotating
    load, its halves form): the tile is fixed per cache shape and nothing
    that varies per call (positions, counts, deltas, how many pieces) is
    specialised on, so :meth:`warm_up` compiles all there are when the
    engine starts, never during a request.
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
        # ... and of every window's offset and strides (_placed keeps it).
        self._chunk_align = math.gcd(16, self.num_heads * self.head_size)
        # Without rotation the kernels never read cos/sin: any pointer will do.
        self._cos_sin = self._offsets
        if (rope := self.rope) is not None:
            assert rope.head_size == self.head_size, "RoPE and KV head sizes differ"
            table = rope.cos_sin_cache.to(self.device, torch.float32)
            self._cos_sin = table.contiguous()  # rows of rotary_dim
        self._kernels = {
            name: kernel_for(self.device.type, name)
            for name in ("save", "load", "halves")
        }
        self._has_halves = rope is not None and (
            rope.is_neox_style and rope.rotary_dim == self.head_size
        )

    @property
    def tile(self) -> tuple[int, int]:
        """(tokens, lanes) one program moves: every head of ``tokens``."""
        lanes = triton.next_power_of_2(self.num_heads * self.head_size)
        return max(1, self.TILE // lanes), lanes

    def warm_up(self) -> None:
        """Compiles the kernels' variants now (a GPU compiles at first use;
        the interpreter needs nothing)."""
        if self.device.type == "cpu":
            return
        ids = torch.zeros(1, dtype=torch.int64, device=self.device)
        launches = [self._save_launch(ids, 0, self._chunk(1), 1)]
        for delta in [0, 1] if self.rope else [0]:  # load, rotating load
            piece = ChunkPiece(self._chunk(1), 0, 0, 1, delta)
            launches.append(self._load_launch([(0, piece)], ids, [0]))
        for kernel, grid, args, options in launches:
            kernel.warmup(*args, grid=grid, **options)

    def save_chunk(
        self, block_ids: torch.Tensor, start: int, count: int
    ) -> torch.Tensor:
        chunk = self._chunk(count)
        if count:
            table = self._table(block_ids, start + count).to(self.device)
            kernel, grid, args, options = self._save_launch(table, start, chunk, count)
            kernel[grid](*args, **options)
        return chunk

    def write_window(
        self, block_ids: torch.Tensor, start: int, window: torch.Tensor, delta: int
    ) -> None:
        piece = ChunkPiece(self._placed(window), 0, start, window.shape[2], delta)
        self._load([ChunkLoad(block_ids, [piece])])

    def load_chunks(self, loads: Sequence[ChunkLoad]) -> None:
        """Every piece in one launch (one per ``MAX_PIECES``): each window
        is first brought to this device and dtype (a copy only where it is
        elsewhere, as :meth:`load_chunk` does)."""
        placed = [
            ChunkLoad(load.block_ids, [
                ChunkPiece(self._placed(piece.window()), 0, piece.dst_start,
                           piece.count, piece.delta)
                for piece in load.pieces
            ])
            for load in loads
        ]  # fmt: skip
        self._load(placed)

    def _load(self, loads: Sequence[ChunkLoad]) -> None:
        """``loads`` whose pieces are placed windows (``src_start`` 0): all
        checked before anything is written, then launched."""
        tables = []
        for load in loads:
            ends = [piece.dst_start + piece.count for piece in load.pieces]
            tables.append(self._table(load.block_ids, max(ends, default=0)))
            for piece in load.pieces:
                self._check_delta(piece.delta)
        pieces = [
            (request, piece)
            for request, load in enumerate(loads)
            for piece in load.pieces
            if piece.count
        ]
        if not pieces:
            return
        # One block table for every request: each piece's starts at its own.
        starts = [0, *itertools.accumulate(len(table) for table in tables)]
        on_host = all(table.device.type == "cpu" for table in tables)
        joined = torch.cat([t if on_host else t.to(self.device) for t in tables])
        for first in range(0, len(pieces), MAX_PIECES):
            group = pieces[first : first + MAX_PIECES]
            kernel, grid, args, options = self._load_launch(group, joined, starts)
            kernel[grid](*args, **options)

    def _load_launch(
        self,
        pieces: Sequence[tuple[int, ChunkPiece]],
        table: torch.Tensor,
        starts: Sequence[int],
    ) -> Launch:
        """The launch loading ``pieces`` (each with its request's index in
        ``starts``: where its blocks start in ``table``, the views' blocks of
        every request, on any device). The piece table travels with the
        block table when that is on the host: one copy to the device."""
        rotate = any(piece.delta for _, piece in pieces)
        halves = rotate and self._has_halves and self.HALVES
        block_t = self._halves_tile[0] if halves else self.tile[0]
        base = pieces[0][1].stored
        element = base.element_size()
        rows, tiles = [], 0
        for request, piece in pieces:
            window = piece.stored
            offset = (window.data_ptr() - base.data_ptr()) // element
            rows += piece_row(tiles, offset, window.stride(0), window.stride(1),
                              piece.dst_start, piece.count, starts[request],
                              piece.delta)  # fmt: skip
            tiles += triton.cdiv(piece.count, block_t)
        host = torch.tensor(rows, dtype=torch.int64)
        if table.device.type == "cpu":
            packed = torch.cat([host, table]).to(self.device)
            host, table = packed[: len(rows)], packed[len(rows) :]
        keys, values = self.layers[0].keys, self.layers[0].values
        args = (
            base, host.to(self.device), len(pieces),
            keys, self._offsets, *keys.stride(), *values.stride(),
            table, self.kernel_block_size, self._cos_sin,
        )  # fmt: skip
        grid = (tiles, len(self.layers))
        common = self._options(MAX_PIECES=MAX_PIECES, CHUNK_ALIGN=self._chunk_align)
        if halves:
            return self._kernels["halves"], grid, args, dict(
                NUM_HEADS=self.num_heads, HALF=self.head_size // 2, BLOCK_T=block_t,
                BLOCK_P=self._halves_tile[1], **common,
            )  # fmt: skip
        rope = self.rope if rotate else None
        return self._kernels["load"], grid, args, dict(
            NUM_HEADS=self.num_heads, HEAD_SIZE=self.head_size,
            ROTARY_DIM=rope.rotary_dim if rope else self.head_size,
            IS_NEOX=rope.is_neox_style if rope else True, ROTATE=rotate,
            BLOCK_T=block_t, BLOCK_HD=self.tile[1], **common,
        )  # fmt: skip

    def _save_launch(
        self, table: torch.Tensor, start: int, chunk: torch.Tensor, count: int
    ) -> Launch:
        block_t, block_hd = self.tile
        keys, values = self.layers[0].keys, self.layers[0].values
        args = (
            chunk, *chunk.stride(),
            keys, self._offsets, *keys.stride(), *values.stride(),
            table, start, count, self.kernel_block_size,
        )  # fmt: skip
        grid = (triton.cdiv(count, block_t), len(self.layers))
        return self._kernels["save"], grid, args, self._options(
            NUM_HEADS=self.num_heads, HEAD_SIZE=self.head_size,
            BLOCK_T=block_t, BLOCK_HD=block_hd,
        )  # fmt: skip

    def _options(self, **constants: Any) -> dict[str, Any]:
        """Compile options of every launch, with the kernel's constants.
        Separate multiply and add, as torch's eager ops round them: the
        same bits as TorchOps, at no cost in a memory-bound kernel."""
        return dict(constants, ALIGN=self._align, num_warps=self.NUM_WARPS,
                    enable_fp_fusion=False)  # fmt: skip

    @property
    def _halves_tile(self) -> tuple[int, int]:
        """(tokens, lanes) of a halves program: lanes hold dimension pairs."""
        lanes = triton.next_power_of_2(self.num_heads * self.head_size // 2)
        return max(1, self.TILE // (2 * lanes)), lanes

    def _chunk(self, count: int) -> torch.Tensor:
        shape = (len(self.layers), 2, count, self.num_heads, self.head_size)
        return torch.empty(shape, dtype=self.layers[0].keys.dtype, device=self.device)

    def _table(self, block_ids: torch.Tensor, end: int) -> torch.Tensor:
        """The views' blocks of a request (on ``block_ids``' device), which
        must hold positions up to ``end``."""
        # int64 whatever the caller's: another dtype compiles another variant.
        table = self.kernel_block_ids(block_ids).to(torch.int64)
        assert end <= table.numel() * self.kernel_block_size, (
            "the chunk runs past the request's block table"
        )
        return table

    def _check_delta(self, delta: int) -> None:
        if delta:
            assert self.rope is not None, "loading at another position needs RoPE"
            assert abs(delta) < len(self._cos_sin), (
                f"delta {delta} outside the RoPE table"
            )

    def _placed(self, window: torch.Tensor) -> torch.Tensor:
        """``window`` on this device, in the cache's dtype, as the load
        kernels address it: tokens dense (``[.., count, H, D]`` strides),
        start and layer and K/V strides multiples of the chunk alignment.
        Copied only where it is not so already (a window of a chunk the
        ops saved, or read from a tier, is)."""
        window = window.to(self.device, self.layers[0].keys.dtype)
        expected = (len(self.layers), 2, window.shape[2], self.num_heads,
                    self.head_size)  # fmt: skip
        assert window.shape == expected, (
            f"chunk {tuple(window.shape)} does not match the cache's {expected}"
        )
        if not self._addressable(window):
            window = window.clone(memory_format=torch.contiguous_format)
            assert self._addressable(window), "a fresh window is misaligned"
        return window

    def _addressable(self, window: torch.Tensor) -> bool:
        dense = (self.num_heads * self.head_size, self.head_size, 1)
        inner = zip(window.shape[2:], window.stride()[2:], dense, strict=True)
        align = self._chunk_align
        return (
            all(size == 1 or stride == want for size, stride, want in inner)
            and window.data_ptr() % (align * window.element_size()) == 0
            and window.stride(0) % align == 0
            and window.stride(1) % align == 0
        )
