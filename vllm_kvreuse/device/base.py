"""The device-ops interface: what the chunk cache may do to paged KV memory.

Everything in vllm-kvreuse that reads or writes a KV tensor goes through a
:class:`DeviceOps` built once per worker, when vLLM registers its KV caches
(:func:`vllm_kvreuse.device.build_ops`). Callers pass block ids and token
positions; they never index a KV tensor themselves and never branch on the
device type.

Conventions (shared by every implementation):
- One layer's KV is addressed through :class:`PagedKV`: ``keys`` and
  ``values`` are ``[num_blocks, block_size, num_kv_heads, head_size]`` views
  (or tensors) whose storage *is* the cache: writing them writes the cache.
  A layout that no such view can describe (vLLM's AMX tiles on CPU) is a
  subclass that overrides how a slot is indexed
  (:meth:`PagedKV.slot_index`); torch ops go through :meth:`PagedKV.read`
  and :meth:`PagedKV.write`, fused kernels only take plain views.
- A request's position ``p`` lives in block ``block_ids[p // block_size]``
  at offset ``p % block_size`` (vLLM's slot mapping). ``block_ids`` are the
  KV cache manager's blocks; when the attention kernels split each into
  ``kernel_blocks_per_block`` smaller blocks (vLLM's kernel block size), the
  views hold the kernel blocks and :meth:`DeviceOps.kernel_block_ids` maps
  one table to the other.
- Keys in the cache are stored after RoPE; values carry no position.
- A stored chunk is one tensor ``[num_layers, 2, num_tokens, H, D]`` (keys,
  then values), in the cache's dtype, on the device the store chose.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class UnsupportedKVLayout(ValueError):
    """The attention backend stores KV in a layout these ops cannot address."""


@dataclass(frozen=True, slots=True)
class PagedKV:
    """Token-addressable views of one layer's paged KV cache.

    ``keys`` and ``values``: ``[num_blocks, block_size, num_kv_heads,
    head_size]``, sharing the cache's storage.
    """

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.keys.shape[1]

    @property
    def token_shape(self) -> tuple[int, int]:
        """``(num_kv_heads, head_size)``: one token's keys (or values)."""
        return self.keys.shape[2], self.keys.shape[3]

    def slot_index(
        self, view: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """The index of the given slots into ``view`` (``keys`` or
        ``values``): one tensor per leading axis, up to a token's own axes."""
        return blocks, offsets

    def read(
        self, blocks: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values at the given slots: ``[n, H, D]``
        each. Mutates nothing."""
        shape = (len(offsets), *self.token_shape)
        keys = self.keys[self.slot_index(self.keys, blocks, offsets)]
        values = self.values[self.slot_index(self.values, blocks, offsets)]
        return keys.reshape(shape), values.reshape(shape)

    def write(
        self,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        """Writes ``[n, H, D]`` keys and values (cast to the cache's dtype)
        into the given slots; mutates only those."""
        for view, tokens in ((self.keys, keys), (self.values, values)):
            index = self.slot_index(view, blocks, offsets)
            token_axes = view.shape[len(index) :]
            view[index] = tokens.to(view.dtype).reshape(len(offsets), *token_axes)


@dataclass(frozen=True, slots=True)
class Rope:
    """The model's rotary embedding, as the data a rotation needs.

    Angles are linear in the position (``pos * inv_freq``), so rotating a key
    already rotated for position ``v`` by ``delta`` gives the key for position
    ``v + delta``. :mod:`vllm_kvreuse.chunk_cache.worker.rope` refuses models for
    which that does not hold.
    """

    cos_sin_cache: torch.Tensor  # [max_position, rotary_dim], float32: cos | sin
    head_size: int
    rotary_dim: int
    is_neox_style: bool
    # vLLM's ApplyRotaryEmb op, built where the vLLM config is current (a
    # CustomOp needs it), so a platform's registered kernel rotates; None:
    # vLLM's torch arithmetic
    apply_rotary: torch.nn.Module | None = None

    def row(self, delta: int) -> torch.Tensor:
        """``[1, rotary_dim]`` cos | sin of a move by ``delta`` positions."""
        return rotation_row(self.cos_sin_cache, delta)[None]


def rotation_row(table: torch.Tensor, delta: int) -> torch.Tensor:
    """cos | sin of a move by ``delta`` positions, from ``table`` (a RoPE
    cos | sin cache by position, on any device): its row ``|delta|``, the
    sines negated when ``delta < 0``. A chunk moves backwards when it was
    computed after a fill context longer than what stands before it."""
    assert abs(delta) < len(table), f"delta {delta} outside the RoPE table"
    row = table[abs(delta)]
    if delta >= 0:
        return row
    cos, sin = row.chunk(2)
    return torch.cat([cos, -sin])


@dataclass(frozen=True, slots=True)
class ChunkPiece:
    """Tokens ``[src_start, src_start + count)`` of ``stored`` (a stored
    chunk, ``[num_layers, 2, n, H, D]``, on any device) for positions
    ``[dst_start, dst_start + count)`` of a request, keys moved by ``delta``
    positions (RoPE; negative when the chunk was computed after a fill
    context longer than what stands before it in the request)."""

    stored: torch.Tensor
    src_start: int
    dst_start: int
    count: int
    delta: int

    def window(self) -> torch.Tensor:
        """The piece's tokens of ``stored``: a view, on its device."""
        window = self.stored[:, :, self.src_start : self.src_start + self.count]
        assert window.shape[2] == self.count, (
            f"tokens [{self.src_start}, {self.src_start + self.count}) of a "
            f"{self.stored.shape[2]}-token chunk"
        )
        return window


@dataclass(frozen=True, slots=True)
class ChunkLoad:
    """The pieces one request loads in a step, into the request whose block
    table (manager blocks, on any device) is ``block_ids``. The pieces write
    disjoint positions, in no particular order."""

    block_ids: torch.Tensor
    pieces: Sequence[ChunkPiece]


class DeviceOps(ABC):
    """Chunk moves over one worker's paged KV cache, every attention layer.

    Invariants: every layer has the same block size, KV heads and head size,
    and one block id names the same block in every layer. Built once; the
    layer views stay valid as long as vLLM's KV caches do.

    ``block_size`` is the KV cache manager's (what block tables count in); it
    defaults to the views' block size and must be a multiple of it.
    """

    name: str = "abstract"

    def __init__(
        self,
        layers: Sequence[PagedKV],
        rope: Rope | None,
        *,
        block_size: int | None = None,
    ) -> None:
        assert layers, "no attention layer was registered"
        self.layers = list(layers)
        self.rope = rope
        self._block_size = block_size or self.kernel_block_size
        assert self._block_size % self.kernel_block_size == 0, (
            f"manager block size {self._block_size} is not a multiple of the "
            f"cache's kernel block size {self.kernel_block_size}"
        )
        self._prepare()

    def _prepare(self) -> None:  # noqa: B027 - a hook, a no-op unless overridden
        """What an implementation checks and computes once of the layers, at
        the end of ``__init__``; raises :class:`UnsupportedKVLayout` for
        layers it cannot address."""

    def warm_up(self) -> None:  # noqa: B027 - a hook, a no-op unless overridden
        """Compiles whatever the ops compile at first use, so that no
        request pays for it; called once when the worker builds the ops.
        Moves nothing."""

    @property
    def device(self) -> torch.device:
        return self.layers[0].keys.device

    @property
    def chunk_layout(self) -> tuple[torch.dtype, tuple[int, int, int, int]]:
        """The dtype and one token's shape ``(layers, 2, H, D)`` of the
        chunks :meth:`save_chunk` returns and :meth:`load_chunk` takes."""
        first = self.layers[0]
        return first.keys.dtype, (len(self.layers), 2, *first.token_shape)

    @property
    def block_size(self) -> int:
        """Tokens per block of the block tables callers pass."""
        return self._block_size

    @property
    def kernel_block_size(self) -> int:
        """Tokens per block of the layer views (vLLM's kernel block size)."""
        return self.layers[0].block_size

    @property
    def kernel_blocks_per_block(self) -> int:
        return self._block_size // self.kernel_block_size

    def kernel_block_ids(self, block_ids: torch.Tensor) -> torch.Tensor:
        """``block_ids`` (manager blocks) as the views' blocks: manager block
        ``b`` is kernel blocks ``b * r .. b * r + r - 1`` (vLLM lays them out
        so; ``group_kernel_blocks`` in ``vllm/v1/kv_cache_interface.py``)."""
        ratio = self.kernel_blocks_per_block
        if ratio == 1:
            return block_ids
        split = torch.arange(ratio, device=block_ids.device, dtype=block_ids.dtype)
        return (block_ids[:, None] * ratio + split).flatten()

    @abstractmethod
    def save_chunk(
        self, block_ids: torch.Tensor, start: int, count: int
    ) -> torch.Tensor:
        """A copy of positions ``[start, start + count)`` of a request whose
        block table is ``block_ids``: ``[num_layers, 2, count, H, D]``.

        Mutates nothing.
        """

    def load_chunk(
        self,
        block_ids: torch.Tensor,
        dst_start: int,
        stored: torch.Tensor,
        src_start: int,
        count: int,
        delta: int,
    ) -> None:
        """Writes tokens ``[src_start, src_start + count)`` of ``stored``
        (``[num_layers, 2, n, H, D]``, on any device) into positions
        ``[dst_start, dst_start + count)`` of the request whose block table is
        ``block_ids``, keys moved by ``delta`` positions (RoPE; negative when
        the chunk was computed after a fill context longer than what stands
        before it in the request).

        Mutates only those slots, in every layer.
        """
        window = ChunkPiece(stored, src_start, dst_start, count, delta).window()
        self.write_window(block_ids, dst_start, window.to(self.device), delta)

    def load_chunks(self, loads: Sequence[ChunkLoad]) -> None:
        """Every piece of ``loads`` (a step's loads, one entry a request), as
        :meth:`load_chunk` loads one. No two pieces may write the same slot:
        an implementation may write them in any order, or all at once.

        Mutates only those slots, in every layer. This default loads piece
        by piece; a fused implementation moves them all in one launch.
        """
        for load in loads:
            block_ids = load.block_ids.to(self.device)
            for piece in load.pieces:
                self.load_chunk(
                    block_ids, piece.dst_start, piece.stored, piece.src_start,
                    piece.count, piece.delta,
                )  # fmt: skip

    @abstractmethod
    def write_window(
        self, block_ids: torch.Tensor, start: int, window: torch.Tensor, delta: int
    ) -> None:
        """:meth:`load_chunk` once the tokens are on this device: ``window``
        (``[num_layers, 2, count, H, D]``) into positions ``[start, start +
        count)``, keys moved by ``delta``. Mutates only those slots."""
