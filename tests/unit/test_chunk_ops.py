"""Device ops and the chunk store's index, on real vLLM kernels and configs."""

from __future__ import annotations

import pytest
import torch
from vllm import _custom_ops as vllm_ops
from vllm.config import ModelConfig, VllmConfig
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.common import ApplyRotaryEmb

from vllm_kvreuse.chunk_cache.worker.rope import UnsupportedModel, model_rope
from vllm_kvreuse.device import Rope
from vllm_kvreuse.device.layouts import cpu_attn_views
from vllm_kvreuse.device.torch_ops import (
    read_tokens,
    rerotate_keys,
    slots_of,
    write_tokens,
)


@pytest.fixture(scope="module")
def rope(model_dir: str) -> Rope:
    config = VllmConfig(model_config=ModelConfig(model_dir, max_model_len=1024))
    return model_rope(config)


def rotate(keys: torch.Tensor, positions: torch.Tensor, rope: Rope):
    _, rotated = RotaryEmbedding.forward_static(
        positions, keys.reshape(len(keys), -1).clone(), keys.reshape(len(keys), -1),
        rope.head_size, rope.rotary_dim, rope.cos_sin_cache, rope.is_neox_style,
    )  # fmt: skip
    return rotated.view(keys.shape)


def test_rerotated_keys_match_keys_computed_at_the_actual_positions(rope) -> None:
    raw = torch.randn(50, 2, rope.head_size)
    virtual = rotate(raw, torch.arange(50), rope)
    actual = rotate(raw, torch.arange(50) + 333, rope)
    moved = rerotate_keys(virtual, 333, rope)
    # float32 cos/sin tables: agreement to float32 rounding of the angles
    torch.testing.assert_close(moved, actual, atol=1e-4, rtol=1e-4)


def test_keys_move_backwards_too(rope) -> None:
    """A chunk computed after a fill context longer than what stands before
    it in the request moves to an earlier position: a negative delta."""
    raw = torch.randn(50, 2, rope.head_size)
    virtual = rotate(raw, torch.arange(50) + 400, rope)
    actual = rotate(raw, torch.arange(50) + 67, rope)
    moved = rerotate_keys(virtual, 67 - 400, rope)
    torch.testing.assert_close(moved, actual, atol=1e-4, rtol=1e-4)


def test_cpu_rotation_broadcasts_one_row_to_the_same_values(rope) -> None:
    """On CPU one cos/sin row is broadcast over the tokens instead of
    expanded to a row per token: the same products, so the same bits."""
    keys = torch.randn(40, 2, rope.head_size)
    cos, sin = rope.cos_sin_cache[333].chunk(2)
    per_token = ApplyRotaryEmb.forward_static(
        keys, cos.expand(40, -1), sin.expand(40, -1), rope.is_neox_style
    )
    assert rope.rotary_dim == rope.head_size and rope.apply_rotary is not None
    assert torch.equal(rerotate_keys(keys, 333, rope), per_token)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
             "original_max_position_embeddings": 256, "rope_theta": 1e4}},
            "YaRNScalingRotaryEmbedding is not linear",
        ),
        ({"architectures": ["PhiForCausalLM"]}, "supports"),
    ],
)  # fmt: skip
def test_models_that_cannot_be_rerotated_exactly_are_refused(
    model_dir: str, overrides: dict, reason: str
) -> None:
    config = ModelConfig(model_dir, max_model_len=1024, hf_overrides=overrides)
    with pytest.raises(UnsupportedModel, match=reason):
        model_rope(VllmConfig(model_config=config))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cpu_layout_matches_vllms_own_cache_writer(dtype) -> None:
    """Tokens written by vLLM's CPU kernel read back through our views, and
    tokens written through our views equal the kernel's cache bytes."""
    blocks, heads, block_size, head_size = 4, 2, 32, 64
    cache = torch.zeros(blocks, heads, block_size, 2 * head_size, dtype=dtype)
    rows = cache.view(blocks, heads, 2 * block_size, head_size)
    key_cache, value_cache = rows.chunk(2, dim=2)
    keys = torch.randn(40, heads, head_size).to(dtype)
    values = torch.randn(40, heads, head_size).to(dtype)
    vllm_ops.cpu_attn_reshape_and_cache(
        keys, values, key_cache, value_cache, torch.arange(10, 50), "vec",
        k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto",
    )  # fmt: skip
    block_ids, offsets = slots_of(torch.arange(blocks), 10, 40, block_size)
    read_keys, read_values = read_tokens(
        cpu_attn_views(cache, block_size, "vec"), block_ids, offsets
    )
    assert torch.equal(read_keys, keys) and torch.equal(read_values, values)
    ours = torch.zeros_like(cache)
    write_tokens(
        cpu_attn_views(ours, block_size, "vec"), block_ids, offsets, keys, values
    )
    assert torch.equal(ours, cache)
