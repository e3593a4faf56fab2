"""A step's chunk loads in one Triton launch (``TritonOps.load_chunks``)
against the same pieces loaded one by one, in Triton's interpreter on CPU.

Both run the same kernel arithmetic, so the batched load must leave the
caches bit for bit as the per-piece loop does (and as the torch reference
does, up to the interpreter's bfloat16 truncation: ``assert_same_caches``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from vllm.v1.kv_cache_interface import KVCacheLayout

from vllm_kvreuse.device import ChunkLoad, ChunkPiece, DeviceOps
from vllm_kvreuse.device.torch_ops import TorchOps

pytest.importorskip("triton")
pytest.importorskip("triton.runtime.interpreter")

from tests.unit.test_device_triton import (
    BLOCK,
    HEAD_SIZE,
    HEADS,
    assert_same_caches,
    content_packed,
    make_rope,
    twins,
)
from vllm_kvreuse.device.triton_kernels import KERNELS, MAX_PIECES, kernel_for
from vllm_kvreuse.device.triton_ops import TritonOps

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
ROPES = {  # (rotary dims, neox, halves kernel)
    "neox-halves": (HEAD_SIZE, True, True),
    "neox-elementwise": (HEAD_SIZE, True, False),
    "gptj": (HEAD_SIZE, False, False),
    "neox-partial": (HEAD_SIZE // 2, True, False),
    "gptj-partial": (8, False, False),
}


@pytest.fixture
def launches() -> Iterator[Counter[str]]:
    """Launches of each interpreted kernel while the test runs (the kernels
    run as they are; a pre-run hook counts them)."""
    counts: Counter[str] = Counter()
    hooks = {}
    for name in KERNELS:
        hooks[name] = lambda *_, name=name, **__: counts.update([name])
        kernel_for("cpu", name).add_pre_run_hook(hooks[name])
    yield counts
    for name, hook in hooks.items():
        kernel_for("cpu", name).pre_run_hooks.remove(hook)


def stored(tokens: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    return torch.randn(3, 2, tokens, HEADS, HEAD_SIZE).to(device, dtype)


def step_loads(dtype: torch.dtype, device: str) -> list[ChunkLoad]:
    """Two requests' pieces: out of position order, of unequal lengths (1
    token among them), moved forwards, backwards and not at all, windows of
    one chunk and of several, some on the host when the cache is not."""
    first, third = stored(50, dtype), stored(40, dtype)
    second = stored(8, dtype, device)  # on the device when the cache is
    request = torch.tensor([5, 2, 0, 4])
    other = torch.tensor([1, 3], device=device)  # blocks no other request has
    return [
        ChunkLoad(request, [
            ChunkPiece(first, 4, 30, 21, 1000),
            ChunkPiece(second, 7, 0, 1, -700),
            ChunkPiece(first, 0, 5, 17, 0),
            ChunkPiece(third, 10, 51, 13, 3),
            ChunkPiece(second, 2, 22, 1, 0),
            ChunkPiece(third, 0, 23, 7, -1),
        ]),
        ChunkLoad(other, [
            ChunkPiece(stored(29, dtype), 0, 3, 29, 2049),
            ChunkPiece(second, 0, 0, 2, -5),
        ]),
    ]  # fmt: skip


def load_piece_by_piece(ops: DeviceOps, loads: list[ChunkLoad]) -> None:
    for load in loads:
        for piece in load.pieces:
            ops.load_chunk(load.block_ids, piece.dst_start, piece.stored,
                           piece.src_start, piece.count, piece.delta)  # fmt: skip


def assert_identical(batched: TritonOps, looped: TritonOps) -> None:
    pairs = zip(batched.layers, looped.layers, strict=True)
    for layer, (got, want) in enumerate(pairs):
        assert torch.equal(got.keys, want.keys), f"layer {layer} keys"
        assert torch.equal(got.values, want.values), f"layer {layer} values"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("kernel_block", [None, BLOCK], ids=["one", "split"])
@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_launch_loads_the_bits_the_per_piece_loop_loads(
    dtype: torch.dtype, rope: str, kernel_block: int | None, device: str, launches
) -> None:
    """Every piece of a step (two requests) in one launch: the caches equal
    the per-piece loop's bit for bit, and the torch reference's, with
    manager blocks of one kernel block or of two (``split``)."""
    rotary_dim, neox, halves = ROPES[rope]
    layers = content_packed(KVCacheLayout.LBNHC, dtype, kernel_block, device)
    block_size = 2 * BLOCK if kernel_block else None
    reference, batched = twins(layers, make_rope(rotary_dim, neox),
                               block_size=block_size)  # fmt: skip
    _, looped = twins(layers, make_rope(rotary_dim, neox), block_size=block_size)
    batched.HALVES = looped.HALVES = halves
    loads = step_loads(dtype, device)

    batched.load_chunks(loads)
    if device == "cpu":
        assert sum(launches.values()) == 1, launches
    load_piece_by_piece(looped, loads)
    reference.load_chunks(loads)  # DeviceOps' default: piece by piece

    assert_identical(batched, looped)
    assert_same_caches(reference, batched)


def test_one_launch_for_n_pieces_and_one_more_past_max_pieces(launches) -> None:
    """N pieces take one launch where the loop takes N; past MAX_PIECES a
    load takes one launch per MAX_PIECES, and still writes every piece."""
    layers = content_packed(KVCacheLayout.LBHNC, torch.float32)
    _, batched = twins(layers, make_rope())
    _, looped = twins(layers, make_rope())
    chunk = stored(MAX_PIECES + 1, torch.float32)
    table = torch.tensor([5, 2, 0, 4, 1])  # room for MAX_PIECES + 1 tokens
    pieces = [ChunkPiece(chunk, i, i, 1, i % 3 - 1) for i in range(MAX_PIECES + 1)]

    batched.load_chunks([ChunkLoad(table, pieces[:8])])
    assert launches == Counter(halves=1)
    load_piece_by_piece(looped, [ChunkLoad(table, pieces[:8])])
    assert launches == Counter(halves=1 + 8 - 3, load=3)  # 3 pieces unmoved
    assert_identical(batched, looped)

    launches.clear()
    batched.load_chunks([ChunkLoad(table, pieces)])
    # Rotation is chosen per launch: the last piece alone, unmoved, needs none.
    assert launches == Counter(halves=1, load=1)
    load_piece_by_piece(looped, [ChunkLoad(table, pieces)])
    assert_identical(batched, looped)


@pytest.mark.parametrize("halves", [True, False], ids=["halves", "elementwise"])
def test_unmoved_pieces_load_without_rotation_and_keep_negative_zeros(
    halves: bool, launches
) -> None:
    """A step whose pieces all keep their positions takes the unrotated
    variant; a delta-0 piece in a rotating launch keeps its bits (-0.0 is
    not rounded through x * 1 + partner * 0)."""
    layers = content_packed(KVCacheLayout.LBNHC, torch.bfloat16)
    _, batched = twins(layers, make_rope())
    _, looped = twins(layers, make_rope())
    batched.HALVES = looped.HALVES = halves
    zeros = -torch.zeros(3, 2, 10, HEADS, HEAD_SIZE, dtype=torch.bfloat16)
    table = torch.tensor([5, 2, 0, 4])
    for loads in (
        [ChunkLoad(table, [ChunkPiece(zeros, 0, 0, 10, 0)])],
        [ChunkLoad(table, [ChunkPiece(zeros, 0, 10, 10, 0),
                           ChunkPiece(stored(5, torch.bfloat16), 0, 20, 5, 9)])],
    ):  # fmt: skip
        batched.load_chunks(loads)
        load_piece_by_piece(looped, loads)
        if len(loads[0].pieces) == 1:
            assert launches == Counter(load=2), "an unmoved step rotated"
    assert_identical(batched, looped)
    keys = batched.save_chunk(table, 0, 20)[:, 0]
    assert torch.signbit(keys).all(), "a -0.0 key lost its sign"


def test_windows_the_kernel_cannot_address_are_copied_first() -> None:
    """A chunk with padded heads, or starting at an unaligned address, is
    copied into a dense aligned window, then loaded with the others."""
    layers = content_packed(KVCacheLayout.LBNHC, torch.float32)
    reference, batched = twins(layers, make_rope())
    padded = torch.randn(3, 2, 12, HEADS, HEAD_SIZE + 3)[..., :HEAD_SIZE]
    flat = torch.randn(1 + 3 * 2 * 9 * HEADS * HEAD_SIZE)
    unaligned = flat[1:].view(3, 2, 9, HEADS, HEAD_SIZE)
    loads = [ChunkLoad(torch.tensor([5, 2, 0, 4]), [
        ChunkPiece(padded, 2, 40, 10, 17),
        ChunkPiece(unaligned, 0, 3, 9, -4),
        ChunkPiece(stored(6, torch.float32), 1, 20, 5, 0),
    ])]  # fmt: skip
    batched.load_chunks(loads)
    reference.load_chunks(loads)
    assert_same_caches(reference, batched)


def test_a_step_with_a_piece_past_its_block_table_writes_nothing() -> None:
    """Every piece is checked before the launch: one bad piece, and no
    piece of the step is written."""
    layers = content_packed(KVCacheLayout.LBNHC, torch.float32)
    _, batched = twins(layers, None)
    before = [kv.keys.clone() for kv in batched.layers]
    chunk = stored(8, torch.float32)
    loads = [
        ChunkLoad(torch.tensor([5, 2]), [ChunkPiece(chunk, 0, 0, 8, 0)]),
        ChunkLoad(torch.tensor([1]), [ChunkPiece(chunk, 0, 10, 8, 0)]),
    ]
    with pytest.raises(AssertionError, match="past the request's block table"):
        batched.load_chunks(loads)
    after = [kv.keys for kv in batched.layers]
    assert all(map(torch.equal, before, after)), "a refused step wrote to the cache"


def test_the_default_load_chunks_is_the_per_piece_loop() -> None:
    """Ops without a fused batch (torch, AMX, NPU) load a step's pieces one
    by one: the same caches as load_chunk for each."""
    layers = content_packed(KVCacheLayout.LBNHC, torch.float32)
    batched, _ = twins(layers, make_rope())
    looped, _ = twins(layers, make_rope())
    assert type(batched).load_chunks is DeviceOps.load_chunks
    loads = step_loads(torch.float32, "cpu")
    batched.load_chunks(loads)
    load_piece_by_piece(looped, loads)
    assert isinstance(looped, TorchOps)
    for got, want in zip(batched.layers, looped.layers, strict=True):
        assert torch.equal(got.keys, want.keys)
        assert torch.equal(got.values, want.values)
