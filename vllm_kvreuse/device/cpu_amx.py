"""vLLM's CPU attention with AMX tiles: bfloat16 KV packed for ``tdpbf16ps``.

vLLM 0.32's CPU_ATTN picks the ``amx`` kernels for a bfloat16 model on an
x86 CPU with AMX tiles (``_get_attn_isa`` in
``vllm/v1/attention/backends/cpu_attn.py``; float16 and float32 take ``vec``).
The cache is still ``[num_blocks, H, block_size, 2 * D]``, but its write op
(``cpu_attn_reshape_and_cache`` with ``isa="amx"``) repacks each
(block, head) page of ``2 * block_size * D`` elements as the B operand of
an AMX tile: 64-byte rows, elements paired into 4-byte words (two bfloat16).

- Keys, the first ``block_size * D`` elements: groups of 16 tokens (a tile's
  16 columns), each ``[D / 2, 16, 2]``: token ``t``, dim ``d`` at
  ``(t // 16) * 16 * D + (d // 2) * 32 + (t % 16) * 2 + d % 2``.
- Values, the next ``block_size * D``: strips of 16 dims, each
  ``[block_size / 2, 16, 2]`` (token pairs): token ``t``, dim ``d`` at
  ``(d // 16) * 16 * block_size + (t // 2) * 32 + (d % 16) * 2 + t % 2``.

Measured, not assumed: ``tests/unit/test_cpu_amx.py`` writes tokens with
vLLM's op and reads them back here, and the reverse (the write op is plain
packing code, so it runs on CPUs without AMX too).

Neither token axis is one stride (16 tokens of a key group are 2 elements
apart, groups ``16 * D``), so no ``[B, N, H, D]`` view exists:
:class:`TiledKV` keeps the token axis split in two and indexes both parts.
"""

from __future__ import annotations

import ctypes
import platform
from dataclasses import dataclass

import torch

from vllm_kvreuse.device.base import PagedKV, UnsupportedKVLayout

TILE_ROW_BYTES = 64
"""One AMX tile row; a B tile has ``64 / 4 = 16`` columns of 4-byte words."""
TILE_COLUMNS = TILE_ROW_BYTES // 4
WORD_ELEMENTS = 2
"""bfloat16 elements per 4-byte word (the pairs ``tdpbf16ps`` multiplies):
the 2s of the shapes below; keys pair dims, values pair tokens."""


@dataclass(frozen=True, slots=True)
class TiledKV(PagedKV):
    """One layer's AMX-packed KV, the token axis split in two.

    ``keys``: ``[num_blocks, block_size / 16, 16, H, D / 2, 2]``;
    ``values``: ``[num_blocks, block_size / 2, 2, H, D / 16, 16]``; token
    ``t`` of a block is ``(t // g, t % g)`` with ``g`` the third axis. Both
    share the cache's storage.
    """

    @property
    def block_size(self) -> int:
        return self.keys.shape[1] * self.keys.shape[2]

    @property
    def token_shape(self) -> tuple[int, int]:
        return self.keys.shape[3], self.keys.shape[4] * self.keys.shape[5]

    def slot_index(
        self, view: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """Block offsets as (group, position in group) of ``view``'s token axes."""
        group = view.shape[2]
        return blocks, offsets // group, offsets % group


def amx_views(cache: torch.Tensor, block_size: int) -> TiledKV:
    """The AMX packing of ``cache`` (``[B, H, block_size, 2 * D]``, dense,
    bfloat16) as :class:`TiledKV`; raises :class:`UnsupportedKVLayout` for
    anything vLLM would not have packed so."""
    num_blocks, num_heads, rows, width = cache.shape
    head_size = width // 2
    if cache.dtype != torch.bfloat16:
        raise UnsupportedKVLayout(
            f"CPU_ATTN amx cache holds {cache.dtype}; its packing is bfloat16's"
        )
    if (
        rows != block_size
        or block_size % (2 * TILE_COLUMNS)  # vLLM's own requirement: 32
        or head_size % TILE_COLUMNS
        or not cache.is_contiguous()
    ):
        raise UnsupportedKVLayout(f"CPU_ATTN amx cache {tuple(cache.shape)}")
    block_stride, head_stride = cache.stride()[:2]
    word_row = TILE_COLUMNS * WORD_ELEMENTS  # elements in one 64-byte row
    key_groups, value_pairs = block_size // TILE_COLUMNS, block_size // WORD_ELEMENTS
    keys = cache.as_strided(
        (num_blocks, key_groups, TILE_COLUMNS, num_heads, head_size // 2, 2),
        (block_stride, TILE_COLUMNS * head_size, 2, head_stride, word_row, 1),
        cache.storage_offset(),
    )
    strips = head_size // TILE_COLUMNS
    values = cache.as_strided(
        (num_blocks, value_pairs, 2, num_heads, strips, TILE_COLUMNS),
        (block_stride, word_row, 1, head_stride, TILE_COLUMNS * block_size, 2),
        cache.storage_offset() + block_size * head_size,
    )
    return TiledKV(keys=keys, values=values)


# Linux x86-64 ABI (arch/x86/include/uapi/asm/prctl.h, asm/unistd_64.h).
_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def request_tile_state() -> bool:
    """Asks Linux for AMX tile state in this process; True when granted.

    A process must ask (``arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)``)
    before its first AMX tile instruction, or that instruction dies of
    SIGILL. vLLM 0.32's CPU attention runs AMX tile instructions (its
    ``amx`` kernels, bfloat16) without asking; oneDNN asks when a GEMM is
    first large enough for AMX. So a worker whose first forward pass is a
    prompt of a few tokens (oneDNN then picks AVX512-BF16) reaches vLLM's
    attention first and dies: measured on plain vLLM 0.32 in bfloat16 with
    a first prompt of 1 to 8 tokens, which a first prompt of 64 avoids.
    The grant is process-wide and asking again is harmless; on CPUs or
    kernels without AMX the call fails and nothing changes.
    """
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    syscall = libc.syscall
    return syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
