"""A Hugging Face cache holding only the configs that vLLM's unit tests name.

vLLM's scheduler and connector tests build a ``ModelConfig`` for a hub model
(mostly ``facebook/opt-125m``) to size the KV cache; they read its
``config.json`` and nothing else (no weights, no tokenizer). There is no hub
here, so this writes config-only snapshots, made from transformers' config
classes with the models' published sizes, into ``<cache>/hf/hub``; the runner
sets ``HF_HOME`` to it with ``HF_HUB_OFFLINE=1``. A test that needs more than a
config (weights, a tokenizer, a processor) fails the same in every mode, and
the comparison ignores it. The configs are the same in every mode, which is
all the comparison needs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REVISION = "0" * 40


def _configs() -> dict[str, Any]:
    from transformers import (
        CLIPVisionConfig,
        Gemma3TextConfig,
        LlamaConfig,
        LlavaConfig,
        OPTConfig,
        Qwen2Config,
        Qwen3Config,
    )

    return {
        # OPTConfig's defaults are opt-125m's.
        "facebook/opt-125m": OPTConfig(architectures=["OPTForCausalLM"]),
        "facebook/opt-350m": OPTConfig(
            architectures=["OPTForCausalLM"],
            hidden_size=1024,
            num_hidden_layers=24,
            ffn_dim=4096,
            num_attention_heads=16,
            word_embed_proj_dim=512,
            do_layer_norm_before=False,
        ),
        "llava-hf/llava-1.5-7b-hf": LlavaConfig(
            architectures=["LlavaForConditionalGeneration"],
            vision_config=CLIPVisionConfig(
                hidden_size=1024,
                image_size=336,
                patch_size=14,
                num_hidden_layers=24,
                intermediate_size=4096,
                num_attention_heads=16,
                projection_dim=768,
            ),
            text_config=LlamaConfig(vocab_size=32064, max_position_embeddings=4096),
            image_token_index=32000,
            vision_feature_layer=-2,
        ),
        "meta-llama/Llama-3.2-1B-Instruct": LlamaConfig(
            architectures=["LlamaForCausalLM"],
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            max_position_embeddings=131072,
            tie_word_embeddings=True,
        ),
        "google/gemma-3-1b-it": Gemma3TextConfig(
            architectures=["Gemma3ForCausalLM"],
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            sliding_window=512,
            vocab_size=262144,
            max_position_embeddings=32768,
        ),
        "Qwen/Qwen3-0.6B": Qwen3Config(
            architectures=["Qwen3ForCausalLM"],
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=40960,
            tie_word_embeddings=True,
        ),
        "Qwen/Qwen1.5-7B": Qwen2Config(
            architectures=["Qwen2ForCausalLM"],
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=151936,
            max_position_embeddings=32768,
        ),
    }


def build(home: Path) -> Path:
    """Writes the snapshots under ``home/hub`` (once); returns ``home``."""
    stamp = home / ".built"
    if stamp.exists():
        return home
    for repo, config in _configs().items():
        folder = home / "hub" / ("models--" + repo.replace("/", "--"))
        snapshot = folder / "snapshots" / REVISION
        snapshot.mkdir(parents=True, exist_ok=True)
        (folder / "refs").mkdir(exist_ok=True)
        (folder / "refs" / "main").write_text(REVISION)
        data = config.to_dict()
        data.setdefault("torch_dtype", "float16")
        (snapshot / "config.json").write_text(json.dumps(data, indent=2) + "\n")
    stamp.write_text("\n".join(_configs()) + "\n")
    return home
