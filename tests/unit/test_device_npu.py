"""vllm-ascend's KV layout through the Ascend device ops.

CPU tensors built exactly as vllm-ascend's runner builds them run the ops'
torch path, which is the slot, view and window logic the NPU path runs too,
checked against the references the CPU layouts use (the cache's own block
rows, the torch ops, vLLM's RoPE). The kernel tests at the end need
``torch_npu`` and an NPU, and skip without them.
"""

from __future__ import annotations

import pytest
import torch
from vllm.config import ModelConfig, VllmConfig

from vllm_kvreuse.chunk_cache.worker.rope import model_rope
from vllm_kvreuse.device import DeviceOps, Rope, UnsupportedKVLayout
from vllm_kvreuse.device.npu import (
    AscendOps,
    ascend_views,
    block_window,
    build_ascend_ops,
    slot_ids,
)
from vllm_kvreuse.device.npu_kernels import gather_sequence, scatter_slots
from vllm_kvreuse.device.torch_ops import TorchOps, slots_of, write_tokens
from vllm_kvreuse.testing.ascend_layout import ASCEND_BLOCK_SIZE, ascend_layer

NUM_BLOCKS = 6
NUM_LAYERS = 3
HEADS = 2
BLOCK_IDS = [4, 1, 5, 0]  # a request's block table, out of order on purpose


@pytest.fixture(scope="module")
def rope(model_dir: str) -> Rope:
    config = VllmConfig(model_config=ModelConfig(model_dir, max_model_len=1024))
    return model_rope(config)


def rotate(keys: torch.Tensor, positions: torch.Tensor, rope: Rope) -> torch.Tensor:
    """``keys`` ``[n, H, D]`` rotated for ``positions`` by vLLM's own RoPE."""
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    flat = keys.reshape(len(keys), -1)
    _, rotated = RotaryEmbedding.forward_static(
        positions, flat.clone(), flat, rope.head_size, rope.rotary_dim,
        rope.cos_sin_cache, rope.is_neox_style,
    )  # fmt: skip
    return rotated.view(keys.shape)


def raw_bytes(layer: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
    return [t.view(torch.int8) for t in layer]


@pytest.mark.parametrize("kernel_block_size", [None, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_slot_writes_land_in_the_rows_vllm_ascend_addresses(
    dtype: torch.dtype, kernel_block_size: int | None
) -> None:
    """A slot id addresses row ``slot`` of the cache as allocated (what
    npu_scatter_pa_kv_cache writes in ND mode), also where scheduler blocks
    are split into kernel blocks; the torch ops' writes over the same views
    produce the same bytes; a gather of the window reads the tokens back."""
    head_size, start, count = 32, 100, 200  # three blocks, starting mid-block
    layer = ascend_layer(
        NUM_BLOCKS, HEADS, head_size, dtype, kernel_block_size=kernel_block_size
    )
    views = ascend_views(layer, ASCEND_BLOCK_SIZE)
    keys = torch.randn(count, HEADS, head_size).to(dtype)
    values = torch.randn(count, HEADS, head_size).to(dtype)
    block_ids = torch.tensor(BLOCK_IDS)

    slots = slot_ids(block_ids, start, count, ASCEND_BLOCK_SIZE)
    assert slots.dtype == torch.int32
    scatter_slots(keys, values, views.keys, views.values, slots)

    rows = [t.reshape(-1, HEADS, head_size) for t in layer]
    assert torch.equal(rows[0][slots.long()], keys)
    assert torch.equal(rows[1][slots.long()], values)
    reference = ascend_layer(
        NUM_BLOCKS, HEADS, head_size, dtype, kernel_block_size=kernel_block_size
    )
    blocks, offsets = slots_of(block_ids, start, count, ASCEND_BLOCK_SIZE)
    write_tokens(
        ascend_views(reference, ASCEND_BLOCK_SIZE), blocks, offsets, keys, values
    )
    for ours, theirs in zip(raw_bytes(layer), raw_bytes(reference), strict=True):
        assert torch.equal(ours, theirs)

    table, skip = block_window(block_ids, start, count, ASCEND_BLOCK_SIZE)
    assert table.tolist() == [BLOCK_IDS[:3]] and skip == start
    read_keys, read_values = gather_sequence(
        views.keys, views.values, table, skip + count
    )
    assert torch.equal(read_keys[skip:], keys)
    assert torch.equal(read_values[skip:], values)


@pytest.mark.parametrize(
    ("start", "count", "blocks", "skip"),
    [
        (0, 128, [4], 0),
        (127, 2, [4, 1], 127),
        (256, 100, [5], 0),
        (130, 300, [1, 5, 0], 2),
    ],
)
def test_block_window_covers_exactly_the_positions(
    start: int, count: int, blocks: list[int], skip: int
) -> None:
    table, first_skip = block_window(
        torch.tensor(BLOCK_IDS), start, count, ASCEND_BLOCK_SIZE
    )
    assert table.tolist() == [blocks] and first_skip == skip
    assert table.dtype == torch.int32


def fill_chunk(
    ops: DeviceOps, keys: torch.Tensor, values: torch.Tensor, block_ids: torch.Tensor
) -> None:
    """Writes ``[L, n, H, D]`` keys/values at positions ``0..n-1``."""
    slots = slot_ids(block_ids, 0, keys.shape[1], ops.block_size)
    for layer, kv in enumerate(ops.layers):
        scatter_slots(
            keys[layer].to(kv.keys.dtype),
            values[layer].to(kv.values.dtype),
            kv.keys,
            kv.values,
            slots,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_saved_chunk_loads_elsewhere_as_if_computed_there(
    rope: Rope, dtype: torch.dtype
) -> None:
    """Keys computed at virtual positions, saved from one request and loaded
    into another at other positions, equal keys computed at the new
    positions by vLLM's RoPE; values are copied; and the Ascend ops write the
    same bytes as the torch ops over the same layout."""
    n, src_start, dst_start = 150, 10, 170
    count, delta = n - src_start, dst_start - src_start
    head_size = rope.head_size
    raw = torch.randn(NUM_LAYERS, n, HEADS, head_size)
    values = torch.randn(NUM_LAYERS, n, HEADS, head_size)
    virtual = torch.stack([rotate(k, torch.arange(n), rope) for k in raw])
    source, target = torch.tensor([2, 3]), torch.tensor([5, 0, 1])

    def caches() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {
            f"layers.{i}.attn": ascend_layer(NUM_BLOCKS, HEADS, head_size, dtype)
            for i in range(NUM_LAYERS)
        }

    ours, theirs = caches(), caches()
    ops = build_ascend_ops(ours, ASCEND_BLOCK_SIZE, rope)
    reference = TorchOps(
        [ascend_views(layer, ASCEND_BLOCK_SIZE) for layer in theirs.values()], rope
    )
    for each in (ops, reference):
        fill_chunk(each, virtual, values, source)
    stored = ops.save_chunk(source, 0, n)
    assert stored.shape == (NUM_LAYERS, 2, n, HEADS, head_size)
    assert torch.equal(stored[:, 0], virtual.to(dtype))
    assert torch.equal(stored[:, 1], values.to(dtype))

    for each in (ops, reference):
        each.load_chunk(target, dst_start, stored, src_start, count, delta)
    for name in ours:
        for a, b in zip(raw_bytes(ours[name]), raw_bytes(theirs[name]), strict=True):
            assert torch.equal(a, b)
    moved = ops.save_chunk(target, dst_start, count)
    positions = torch.arange(dst_start, dst_start + count)
    expected = torch.stack([rotate(k[src_start:], positions, rope) for k in raw])
    # float32 cos/sin tables; bfloat16 storage rounds the keys twice
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(
        moved[:, 0].float(), expected, atol=tolerance, rtol=tolerance
    )
    assert torch.equal(moved[:, 1], values[:, src_start:].to(dtype))


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: torch.zeros(2, 4, 128, 2, 32), "not a \\(k_cache, v_cache\\) pair"),
        (lambda: (torch.zeros(4, 128, 2, 32),), "not a \\(k_cache, v_cache\\) pair"),
        (  # MLA: nope and rope caches differ in their last dim
            lambda: (torch.zeros(4, 128, 1, 512), torch.zeros(4, 128, 1, 64)),
            "vllm-ascend KV cache",
        ),
        (  # kernel blocks that do not tile a 128-token scheduler block
            lambda: ascend_layer(4, 2, 32, torch.float16, block_size=96),
            "do not tile",
        ),
        (
            lambda: tuple(t.mT for t in ascend_layer(4, 2, 2, torch.float16)),
            "non-contiguous",
        ),
    ],
)  # fmt: skip
def test_layouts_the_ops_cannot_address_are_refused(make, reason: str) -> None:
    with pytest.raises(UnsupportedKVLayout, match=reason):
        ascend_views(make(), ASCEND_BLOCK_SIZE)


# -- on an NPU ------------------------------------------------------------------


@pytest.fixture
def npu() -> torch.device:
    pytest.importorskip("torch_npu", reason="torch_npu (with CANN) is not installed")
    if not torch.npu.is_available():
        pytest.skip("no NPU visible to torch_npu")
    return torch.device("npu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_npu_kernels_match_the_torch_path(
    npu: torch.device, rope: Rope, dtype: torch.dtype
) -> None:
    """The kernel path (scatter, gather, Triton or npu_rotary_mul rotation)
    writes what the torch path writes on CPU, and build_ops picks it."""
    from vllm_kvreuse.device import build_ops

    head_size, n, dst_start, delta = rope.head_size, 200, 300, 290
    stored = torch.randn(NUM_LAYERS, 2, n, HEADS, head_size).to(dtype)
    source, target = torch.tensor([1, 3]), torch.tensor([4, 2, 0, 5])
    results = []
    for device in (torch.device("cpu"), npu):
        caches = {
            f"layers.{i}.attn": ascend_layer(
                NUM_BLOCKS, HEADS, head_size, dtype, device=device
            )
            for i in range(NUM_LAYERS)
        }
        ops = (
            build_ops(caches, {}, ASCEND_BLOCK_SIZE, rope)
            if device.type == "npu"
            else build_ascend_ops(caches, ASCEND_BLOCK_SIZE, rope)
        )
        assert isinstance(ops, AscendOps)
        ops.load_chunk(source.to(device), 0, stored, 0, n, 0)
        ops.load_chunk(target.to(device), dst_start, stored, 5, n - 5, delta)
        results.append(
            (ops.save_chunk(source.to(device), 0, n).cpu(),
             ops.save_chunk(target.to(device), dst_start, n - 5).cpu())
        )  # fmt: skip
    (cpu_saved, cpu_moved), (npu_saved, npu_moved) = results
    assert torch.equal(npu_saved, cpu_saved)
    assert torch.equal(npu_moved[:, 1], cpu_moved[:, 1])
    # the kernels round float32 differently: one bfloat16 ulp
    torch.testing.assert_close(
        npu_moved.float(), cpu_moved.float(), atol=2e-2, rtol=2e-2
    )
