"""Segmented prefill: chunk tokens recomputed in the request, not a suffix.

Each test checks the engine against the Hugging Face model run step by step
with its own KV cache (:func:`~vllm_kvreuse.testing.reference.segmented_reference`):
loaded rows as stored, recomputed rows attending causally to everything
before them. One chunk-cache engine per test (one per process at a time).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from tests.conftest import BLOCK_SIZE
from tests.integration.chunks import (
    DOC_A,
    DOC_B,
    QUESTION,
    SYSTEM,
    chunk_cache_llm,
    generate,
    hf_reference,
    index_of,
)
from tests.integration.conftest import num_free_blocks, scheduler_of
from vllm_kvreuse.chunk_cache.frontend import chunked_prompt
from vllm_kvreuse.chunk_cache.recompute import Recompute, choose_spans
from vllm_kvreuse.config import KVReuseConfig
from vllm_kvreuse.testing.reference import segmented_reference

STEPS = 6
# chunk_cache_llm turns recompute off unless told; these are the defaults.
DEFAULTS = {
    name: getattr(KVReuseConfig(), name)
    for name in (
        "chunk_recompute_head",
        "chunk_recompute_select",
        "chunk_recompute_fraction",
    )
}
# The question names tokens of DOC_B: question-driven selection picks it.
ABOUT_B = QUESTION + DOC_B[5:8]


def _check(
    llm,
    hf_model,
    segments: list[list[int]],
    settings: Recompute,
    context: list[int] | None = None,
    recompute: object = None,
) -> torch.Tensor:
    """The engine's answer equals the reference's; returns the reference's
    first-step log-probs."""
    token_ids, lengths = chunked_prompt(segments)
    spans = choose_spans(token_ids, lengths, settings)
    assert spans or context, "the settings must recompute something"
    expected, logprobs = segmented_reference(
        hf_model, token_ids, lengths, spans, STEPS, context=context or ()
    )
    out = generate(llm, segments, max_tokens=STEPS, recompute=recompute)
    assert list(out.outputs[0].token_ids) == expected
    for token, entry in out.outputs[0].logprobs[0].items():
        assert abs(entry.logprob - float(logprobs[token])) < 1e-3
    return logprobs


@pytest.mark.parametrize(
    ("flags", "settings"),
    [
        ({"chunk_recompute_head": 8}, Recompute(head=8)),
        ({"chunk_recompute_select": 0.3}, Recompute(select=0.3)),
        (
            {
                "chunk_recompute_head": 4,
                "chunk_recompute_select": 0.2,
                "chunk_recompute_fraction": 0.1,
            },
            Recompute(head=4, select=0.2, tail=0.1),
        ),
    ],
    ids=["head", "select", "head+select+tail"],
)
def test_recomputed_spans_match_the_hf_reference(
    model_dir: str, hf_model, flags: dict, settings: Recompute
) -> None:
    """Cold (fills, then segments) and warm in another order, both equal
    the reference; the pool is back where it started."""
    with chunk_cache_llm(model_dir, **flags) as llm:
        free = num_free_blocks(llm)
        _check(llm, hf_model, [SYSTEM, DOC_A, DOC_B, ABOUT_B], settings)
        hits = index_of(llm).stats.hit_tokens
        _check(llm, hf_model, [SYSTEM, DOC_B, DOC_A, ABOUT_B], settings)
        assert index_of(llm).stats.hit_tokens > hits
        assert num_free_blocks(llm) == free


def test_a_segmented_request_sent_again_hits_the_prefix_cache(
    model_dir: str, hf_model
) -> None:
    """Its blocks (loaded and recomputed) are hashed under a salt naming the
    spans: the same request finds them all, another split finds none."""
    with chunk_cache_llm(model_dir, chunk_recompute_head=8) as llm:
        segments = [SYSTEM, DOC_A, DOC_B, QUESTION]
        first = generate(llm, segments)
        again = generate(llm, segments)
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        total = len(SYSTEM + DOC_A + DOC_B + QUESTION)
        assert again.num_cached_tokens >= total - total % BLOCK_SIZE - BLOCK_SIZE
        assert not scheduler_of(llm).connector.scheduler_side.plans


def test_the_default_settings_match_the_hf_reference(model_dir: str, hf_model) -> None:
    """``--enable-chunk-cache`` alone recomputes what its defaults say
    (docs/chunk_cache.md: the setting that keeps the most answers at >= 3x)."""
    defaults = KVReuseConfig()
    settings = Recompute(
        head=defaults.chunk_recompute_head,
        select=defaults.chunk_recompute_select,
        tail=defaults.chunk_recompute_fraction,
    )
    with chunk_cache_llm(model_dir, **DEFAULTS) as llm:
        _check(llm, hf_model, [SYSTEM, DOC_A, DOC_B, ABOUT_B], settings)


def test_a_request_may_ask_for_no_recompute(model_dir: str, hf_model) -> None:
    """``chunk_recompute: "none"`` loads every chunk whatever the server's
    settings (the fastest setting), as the chunk-isolated reference says."""
    with chunk_cache_llm(model_dir, chunk_recompute_head=8) as llm:
        generate(llm, [SYSTEM, DOC_A, DOC_B, QUESTION], recompute="none")
        segments = [SYSTEM, DOC_B, DOC_A, QUESTION]  # every chunk stored
        expected, _ = hf_reference(hf_model, segments, steps=STEPS)
        out = generate(llm, segments, recompute="none")
        assert list(out.outputs[0].token_ids) == expected
        assert out.num_cached_tokens >= len(SYSTEM + DOC_A + DOC_B) - BLOCK_SIZE


def test_chunks_computed_after_a_fill_context_match_the_hf_reference(
    model_dir: str, hf_model, tmp_path
) -> None:
    """With ``--chunk-fill-context FILE`` every chunk but the system prompt
    is stored as computed after the file's tokens, and loaded by moving its
    keys back (the context is longer than the system prompt): cold and warm
    in another order, with recomputed heads and with none, equal the
    reference built that way, which differs from the one without context."""
    text = "An earlier record about a harbour town and its old lighthouse. " * 4
    path = tmp_path / "context.txt"
    path.write_text(text)
    context = AutoTokenizer.from_pretrained(model_dir).encode(
        text, add_special_tokens=False
    )
    assert len(context) > len(SYSTEM), "keys must move backwards"
    with chunk_cache_llm(
        model_dir, chunk_fill_context=str(path), chunk_recompute_head=8
    ) as llm:
        free = num_free_blocks(llm)
        first = [SYSTEM, DOC_A, DOC_B, QUESTION]
        with_context = _check(llm, hf_model, first, Recompute(head=8), context)
        hits = index_of(llm).stats.hit_tokens
        reordered = [SYSTEM, DOC_B, DOC_A, QUESTION]
        _check(llm, hf_model, reordered, Recompute(), context, recompute="none")
        assert index_of(llm).stats.hit_tokens > hits
        assert num_free_blocks(llm) == free
    token_ids, lengths = chunked_prompt(first)
    spans = choose_spans(token_ids, lengths, Recompute(head=8))
    _, without = segmented_reference(hf_model, token_ids, lengths, spans, STEPS)
    assert (with_context - without).abs().max() > 1e-2, "the context changed nothing"
