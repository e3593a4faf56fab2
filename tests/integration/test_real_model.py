"""The plugin on a real pretrained model (SmolLM2-135M-Instruct, float32,
greedy), where random weights cannot judge: one engine with the chunk cache,
continuation and engine beam search, checked against Hugging Face
transformers on the same weights and against plain recomputation. The
answers themselves must be right too ("Lisbon", "Paris", "Berlin"): a
random-weight model gives equal tokens just as well, but never a right one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from vllm import LLM, SamplingParams
from vllm.sampling_params import BeamSearchParams

from tests.integration.chunks import chunk_cache_llm, generate, stored_reference
from vllm_kvreuse.chunk_cache.frontend.segments import tokenize_segments

pytestmark = [
    pytest.mark.usefixtures("no_leak"),
    # A 30-layer model through the interpreted V2 runner would take most of
    # CI's V2 budget; the tiny model shows V2's tokens equal V1's.
    pytest.mark.v1_only("CI time: 135M model under the interpreted V2 runner"),
]

# ChatML, SmolLM2's chat format; each document is a message of its own, so
# that a chunk, which attends only to itself, is a well-formed message.
END = "<|im_end|>\n"
ANSWER = "<|im_start|>assistant\n"


def user(text: str) -> str:
    return f"<|im_start|>user\n{text}{END}"


SYSTEM = f"<|im_start|>system\nAnswer the question from the documents.{END}"
TOWER = user("Document: The Kelmar Tower is in Lisbon. It is 120 metres tall.")
BRIDGE = user("Document: The Vantor Bridge is in Oslo. It was built in 1873.")
ASK_TOWER = user("In which city is the Kelmar Tower?") + ANSWER
FRANCE = user("What is the capital of France?") + ANSWER
GERMANY = "\n" + user("And the capital of Germany?") + ANSWER


@pytest.fixture(scope="module")
def llm(smollm2_dir: str) -> Iterator[LLM]:
    with chunk_cache_llm(
        smollm2_dir, enable_continuation=True, engine_beam_search=True,
        max_logprobs=32,
    ) as engine:  # fmt: skip
        yield engine


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def hf_model(smollm2_dir: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@torch.no_grad()
def hf_greedy(
    model: Any, segments: list[list[int]], steps: int
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and first-step log-probs after ``segments`` in
    transformers, full attention."""
    token_ids = [token for segment in segments for token in segment]
    total = len(token_ids)
    out = model(
        input_ids=torch.tensor([token_ids]),
        position_ids=torch.arange(total)[None],
        use_cache=True,
    )
    first = torch.log_softmax(out.logits[0, -1], dim=-1)
    generated = [int(out.logits[0, -1].argmax())]
    for step in range(1, steps):  # generated tokens see everything: no mask
        out = model(
            input_ids=torch.tensor([generated[-1:]]),
            position_ids=torch.tensor([[total + step - 1]]),
            past_key_values=out.past_key_values,
            use_cache=True,
        )
        generated.append(int(out.logits[0, -1].argmax()))
    return generated, first


def greedy(max_tokens: int, **extra_args: Any) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, extra_args=extra_args or None
    )


def test_chunked_prompt_matches_hf(llm, hf_model, tokenizer):
    """First sight (every chunk computed in place) is full attention; warm
    is the same; with the documents swapped, each is loaded as computed
    where first seen, moved by RoPE: the reference's greedy tokens and
    first-step log-probs, and the answer from the documents."""
    cold = tokenize_segments([SYSTEM, TOWER, BRIDGE, ASK_TOWER], tokenizer)
    swapped = tokenize_segments([SYSTEM, BRIDGE, TOWER, ASK_TOWER], tokenizer)
    for segments, seen in ((cold, []), (swapped, [cold])):
        expected, logprobs = stored_reference(hf_model, seen, segments, steps=8)
        for _ in ("first", "again"):
            out = generate(llm, segments, max_tokens=8)
            assert list(out.outputs[0].token_ids) == expected
            for token, logprob in out.outputs[0].logprobs[0].items():
                assert logprob.logprob == pytest.approx(
                    float(logprobs[token]), abs=2e-3
                )
        if not seen:  # right from the documents; moved with nothing
            # recomputed, this 135M model answers "Oslo", as the reference does
            assert "Lisbon" in tokenizer.decode(expected)
    assert out.num_cached_tokens >= sum(map(len, swapped[:-1]))


@torch.no_grad()
def hf_logprob_sum(model: Any, prompt: list[int], continuation: list[int]) -> float:
    """Sum of the log-probs of ``continuation`` after ``prompt`` (teacher forced)."""
    logits = model(input_ids=torch.tensor([prompt + continuation])).logits[0]
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return float(logprobs[torch.arange(len(continuation)), continuation].sum())


def test_engine_beams_equal_vllms_beams_and_hf_scores(llm, hf_model, tokenizer):
    prompt = tokenizer.encode(FRANCE)
    params = BeamSearchParams(beam_width=4, max_tokens=8)
    batch = [{"prompt_token_ids": prompt}]
    (expected,) = type(llm).beam_search.__wrapped__(llm, batch, params)
    (got,) = llm.beam_search(batch, params)
    assert [s.tokens for s in got.sequences] == [s.tokens for s in expected.sequences]
    for have, want in zip(got.sequences, expected.sequences, strict=True):
        assert have.cum_logprob == pytest.approx(want.cum_logprob, abs=1e-3)
        generated = have.tokens[len(prompt) :]
        hf = hf_logprob_sum(hf_model, prompt, generated)
        assert have.cum_logprob == pytest.approx(hf, abs=1e-2)
    assert "Paris" in got.sequences[0].text


def test_continuation_child_equals_a_full_recompute(llm, hf_model, tokenizer):
    """A second chat turn continued from the first's retained KV: the tokens
    of the same sequence computed from scratch, by vLLM and by transformers."""
    prompt = tokenizer.encode(FRANCE)
    (parent,) = llm.generate(
        [{"prompt_token_ids": prompt}], greedy(16, retain_kv=True), use_tqdm=False
    )
    assert "Paris" in parent.outputs[0].text
    suffix = tokenizer.encode(GERMANY)
    child = llm.generate_continuation(parent.request_id, suffix, greedy(10))
    sequence = prompt + list(parent.outputs[0].token_ids) + suffix
    assert child.prompt_token_ids == sequence
    assert child.num_cached_tokens == len(sequence) - len(suffix) - 1
    llm.reset_prefix_cache()  # releases the parent; the recompute hits nothing
    (fresh,) = llm.generate([{"prompt_token_ids": sequence}], greedy(10))
    assert fresh.num_cached_tokens == 0
    assert child.outputs[0].token_ids == fresh.outputs[0].token_ids
    steps = len(fresh.outputs[0].token_ids)
    assert list(child.outputs[0].token_ids) == hf_greedy(hf_model, [sequence], steps)[0]
    assert "Berlin" in child.outputs[0].text
