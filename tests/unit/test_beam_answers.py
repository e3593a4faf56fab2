"""The engine's beams as ``LLM.beam_search``'s output: the same text as
vLLM's loop gives each final beam (``tokenizer.decode`` of prompt + beam)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from vllm.sampling_params import BeamSearchParams
from vllm.tokenizers import get_tokenizer

from vllm_kvreuse.beam.answers import offline_beam_output
from vllm_kvreuse.testing.beam_outputs import root_output


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: str) -> Any:
    return get_tokenizer(smollm2_dir)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_each_beam_text_is_the_decode_of_prompt_and_beam(
    tokenizer: Any, skip_special_tokens: bool
) -> None:
    rng = random.Random(7)
    vocab = len(tokenizer)
    # Special tokens (0, 1 and 2 in SmolLM2's vocabulary), and spaces
    # before punctuation, which transformers' clean-up step may rewrite.
    special = [*tokenizer.all_special_ids, *tokenizer.encode(" , . ? !")]
    prompt = [rng.choice(special) if rng.random() < 0.2 else rng.randrange(vocab)
              for _ in range(70)]  # fmt: skip
    beams = [[rng.choice([*special, rng.randrange(vocab)]) for _ in range(4)]
             for _ in range(12)]  # fmt: skip
    params = BeamSearchParams(
        beam_width=12, max_tokens=4, skip_special_tokens=skip_special_tokens
    )

    got = offline_beam_output(root_output(prompt, beams), {}, params, tokenizer)

    assert [seq.tokens for seq in got.sequences] == [prompt + b for b in beams]
    want = [
        tokenizer.decode(prompt + b, skip_special_tokens=skip_special_tokens)
        for b in beams
    ]
    assert [seq.text for seq in got.sequences] == want
    assert all(isinstance(seq.text, str) for seq in got.sequences)
