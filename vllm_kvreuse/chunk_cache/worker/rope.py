"""The model's RoPE, checked for exact re-rotation, as :class:`ops.Rope`.

Re-rotating a cached key from its virtual position ``v`` to its actual
position ``a`` applies the rotation of ``a - v``. That is exact only when
the rotary angle is ``position * inv_freq`` with fixed frequencies and no
magnitude scaling: vLLM's plain, linear-scaling and Llama-3 rotary
embeddings. Everything else (YaRN's mscale, LongRoPE's length switch,
M-RoPE's 3-D positions, ...) is refused at start-up.

A platform plugin may register its own class for a rotary embedding
(vllm-ascend registers ``AscendRotaryEmbedding`` for ``RotaryEmbedding``
through vLLM's ``CustomOp.register_oot``): such a subclass computes the
same rotation with another kernel, so a class is judged by its nearest
ancestor that vLLM defines.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.common import ApplyRotaryEmb
from vllm.model_executor.layers.rotary_embedding.linear_scaling_rope import (
    LinearScalingRotaryEmbedding,
)
from vllm.model_executor.layers.rotary_embedding.llama3_rope import (
    Llama3RotaryEmbedding,
)

from vllm_kvreuse.device.base import Rope

EXACT_ROPES = (RotaryEmbedding, LinearScalingRotaryEmbedding, Llama3RotaryEmbedding)
"""vLLM's rotary embeddings whose angle is linear in the position. vLLM's
other rotary classes (YaRN, NTK, LongRoPE, ...) subclass these, so
membership is by the nearest vLLM class, never by ``issubclass``."""

NEOX_ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    }
)
"""Architectures whose vLLM model applies neox-style RoPE to every key
(checked against their vLLM model files; others are refused rather than
guessed)."""


class UnsupportedModel(ValueError):
    """The model's keys cannot be moved to another position exactly."""


def nearest_vllm_class(cls: type) -> type:
    """The first class in ``cls``'s method resolution order that vLLM itself
    defines: ``cls`` for vLLM's own classes, the class a platform plugin's
    subclass stands in for otherwise."""
    for klass in cls.__mro__:
        if klass.__module__.partition(".")[0] == "vllm":
            return klass
    return object


def is_exact_rope(cls: type) -> bool:
    """Whether ``cls`` rotates linearly in the position: one of
    :data:`EXACT_ROPES`, or a platform's subclass of one (not a vLLM
    subclass such as YaRN, which changes the angles)."""
    return nearest_vllm_class(cls) in EXACT_ROPES


def model_rope(vllm_config: Any) -> Rope:
    """The rotation data of the model's RoPE, or :class:`UnsupportedModel`."""
    model_config = vllm_config.model_config
    hf_config = model_config.hf_text_config
    architectures = set(getattr(model_config.hf_config, "architectures", None) or [])
    if not architectures & NEOX_ARCHITECTURES:
        raise UnsupportedModel(
            f"the chunk cache re-rotates keys with RoPE and supports "
            f"{sorted(NEOX_ARCHITECTURES)}; this model is {sorted(architectures)}"
        )
    head_size = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    with set_current_vllm_config(vllm_config):
        rope = get_rope(
            head_size,
            max_position=model_config.max_model_len,
            is_neox_style=True,
            rope_parameters=getattr(hf_config, "rope_parameters", None),
            dtype=torch.float32,
        )
        # a CustomOp resolves its platform implementation when built, which
        # needs the config current
        apply_rotary = ApplyRotaryEmb(
            enforce_enable=True, is_neox_style=rope.is_neox_style
        )
    if not is_exact_rope(type(rope)):
        raise UnsupportedModel(
            f"the model's rotary embedding {type(rope).__name__} is not linear in "
            "the position, so cached keys cannot be re-rotated exactly"
        )
    return Rope(
        cos_sin_cache=rope.cos_sin_cache.to(torch.float32),
        head_size=rope.head_size,
        rotary_dim=rope.rotary_dim,
        is_neox_style=rope.is_neox_style,
        apply_rotary=apply_rotary,
    )
