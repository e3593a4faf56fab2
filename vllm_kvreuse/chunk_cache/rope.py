"""The model's RoPE, checked for exact re-rotation, as :class:`ops.Rope`.

Re-rotating a cached key from its virtual position ``v`` to its actual
position ``a`` applies the rotation of ``a - v``. That is exact only when
the rotary angle is ``position * inv_freq`` with fixed frequencies and no
magnitude scaling: vLLM's plain, linear-scaling and Llama-3 rotary
embeddings. Everything else (YaRN's mscale, LongRoPE's length switch,
M-RoPE's 3-D positions, ...) is refused at start-up.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.linear_scaling_rope import (
    LinearScalingRotaryEmbedding,
)
from vllm.model_executor.layers.rotary_embedding.llama3_rope import (
    Llama3RotaryEmbedding,
)

from vllm_kvreuse.device.base import Rope

EXACT_ROPES = (RotaryEmbedding, LinearScalingRotaryEmbedding, Llama3RotaryEmbedding)
"""Rotary embeddings whose angle is linear in the position (type equality)."""

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
    if type(rope) not in EXACT_ROPES:
        raise UnsupportedModel(
            f"the model's rotary embedding {type(rope).__name__} is not linear in "
            "the position, so cached keys cannot be re-rotated exactly"
        )
    return Rope(
        cos_sin_cache=rope.cos_sin_cache.to(torch.float32),
        head_size=rope.head_size,
        rotary_dim=rope.rotary_dim,
        is_neox_style=rope.is_neox_style,
    )
