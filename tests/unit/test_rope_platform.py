"""A platform's own RoPE classes, registered as vllm-ascend registers them.

vllm-ascend replaces vLLM's ``RotaryEmbedding`` and ``ApplyRotaryEmb`` by
subclasses through ``CustomOp.register_oot``, so a model built on Ascend
holds its classes. These tests register real subclasses the same way on CPU
(and unregister them after), then build the model's RoPE as the chunk cache
does.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from vllm.config import ModelConfig, VllmConfig
from vllm.model_executor.custom_op import CustomOp, op_registry_oot
from vllm.model_executor.layers.rotary_embedding import (
    _ROPE_DICT,
    DynamicNTKScalingRotaryEmbedding,
    LinearScalingRotaryEmbedding,
    Llama3RotaryEmbedding,
    MRotaryEmbedding,
    Phi3LongRoPEScaledRotaryEmbedding,
    RotaryEmbedding,
    YaRNScalingRotaryEmbedding,
)
from vllm.model_executor.layers.rotary_embedding.common import ApplyRotaryEmb

from vllm_kvreuse.chunk_cache.worker.rope import (
    UnsupportedModel,
    is_exact_rope,
    model_rope,
)
from vllm_kvreuse.device import Rope
from vllm_kvreuse.device.torch_ops import rerotate_keys


class PlatformRotaryEmbedding(RotaryEmbedding):
    """Stands in for vllm-ascend's AscendRotaryEmbedding: same angles, its
    own kernel (here vLLM's native one)."""

    def forward_oot(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)


class PlatformYaRN(YaRNScalingRotaryEmbedding):
    """Stands in for vllm-ascend's AscendYaRNRotaryEmbedding."""


class RecordingApplyRotaryEmb(ApplyRotaryEmb):
    """A platform's ApplyRotaryEmb that counts the tokens it rotates."""

    tokens = 0

    def forward_native(self, x, cos, sin):
        type(self).tokens += x.shape[-3]
        return super().forward_native(x, cos, sin)


@pytest.fixture
def register_oot() -> Iterator:
    """Registers classes in vLLM's out-of-tree op registry for one test."""
    names: list[str] = []

    def register(name: str, cls: type) -> None:
        CustomOp.register_oot(_decorated_op_cls=cls, name=name)
        names.append(name)

    yield register
    for name in names:
        del op_registry_oot[name]
    # get_rope caches instances by its arguments; drop the platform's
    for key in [k for k, v in _ROPE_DICT.items() if type(v).__module__ == __name__]:
        del _ROPE_DICT[key]


def config(model_dir: str, max_model_len: int, **overrides) -> VllmConfig:
    model = ModelConfig(model_dir, max_model_len=max_model_len, hf_overrides=overrides)
    return VllmConfig(model_config=model)


@pytest.mark.parametrize(
    ("cls", "exact"),
    [
        (RotaryEmbedding, True),
        (LinearScalingRotaryEmbedding, True),
        (Llama3RotaryEmbedding, True),
        (PlatformRotaryEmbedding, True),
        (type("Nested", (PlatformRotaryEmbedding,), {}), True),
        (YaRNScalingRotaryEmbedding, False),  # a vLLM subclass of RotaryEmbedding
        (DynamicNTKScalingRotaryEmbedding, False),
        (Phi3LongRoPEScaledRotaryEmbedding, False),
        (MRotaryEmbedding, False),
        (PlatformYaRN, False),
    ],
)
def test_exactness_is_judged_by_the_nearest_vllm_class(cls: type, exact: bool) -> None:
    assert is_exact_rope(cls) is exact


def test_a_platform_rope_for_an_exact_class_is_accepted(
    model_dir: str, register_oot
) -> None:
    """With the platform's class registered, the model's RoPE is that class
    (as on Ascend), and the chunk cache accepts it with vLLM's angles."""
    upstream = model_rope(config(model_dir, 640))
    register_oot("RotaryEmbedding", PlatformRotaryEmbedding)
    rope = model_rope(config(model_dir, 641))
    built = [v for v in _ROPE_DICT.values() if isinstance(v, PlatformRotaryEmbedding)]
    assert len(built) == 1 and built[0].max_position_embeddings == 641
    torch.testing.assert_close(rope.cos_sin_cache[:640], upstream.cos_sin_cache)


def test_a_platform_rope_for_a_non_linear_class_is_refused(
    model_dir: str, register_oot
) -> None:
    register_oot("YaRNScalingRotaryEmbedding", PlatformYaRN)
    yarn = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "rope_theta": 1e4,
    }
    # A max length no other test uses: get_rope caches instances by arguments.
    with pytest.raises(UnsupportedModel, match="PlatformYaRN is not linear"):
        model_rope(config(model_dir, 1023, rope_parameters=yarn))


def test_keys_rotate_through_the_platforms_apply_rotary_op(
    model_dir: str, register_oot
) -> None:
    """rerotate_keys calls the ApplyRotaryEmb the platform registered (on
    Ascend, npu_rotary_mul), with the same result as vLLM's arithmetic."""
    register_oot("ApplyRotaryEmb", RecordingApplyRotaryEmb)
    rope = model_rope(config(model_dir, 1024))
    assert isinstance(rope.apply_rotary, RecordingApplyRotaryEmb)
    keys = torch.randn(2, 37, 2, rope.head_size)  # [layers, tokens, H, D]
    before = RecordingApplyRotaryEmb.tokens
    moved = rerotate_keys(keys, 300, rope)
    assert RecordingApplyRotaryEmb.tokens - before == 37
    plain = Rope(rope.cos_sin_cache, rope.head_size, rope.rotary_dim, True)
    assert plain.apply_rotary is None
    torch.testing.assert_close(moved, rerotate_keys(keys, 300, plain))
