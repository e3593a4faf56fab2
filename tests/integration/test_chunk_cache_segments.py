"""Segmented prefill: loads, chunks computed in place and recomputed tokens.

Each test checks the engine against the Hugging Face model run step by step
with its own KV cache (:func:`~vllm_kvreuse.testing.reference.segmented_reference`):
loaded rows as computed where their chunk was first seen, computed rows
attending causally to everything before them. One chunk-cache engine per
test (one per process at a time).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import BLOCK_SIZE
from tests.integration.chunks import (
    DOC_A,
    DOC_B,
    QUESTION,
    SYSTEM,
    chunk_cache_llm,
    expected_spans,
    full_attention,
    generate,
    index_of,
    sources_after,
    stored_reference,
)
from tests.integration.conftest import (
    num_free_blocks,
    reference_tolerance,
    scheduler_of,
)
from vllm_kvreuse.chunk_cache.engine.recompute import Recompute
from vllm_kvreuse.chunk_cache.engine.said import PREFILL_STEPS
from vllm_kvreuse.chunk_cache.frontend.segments import chunked_prompt
from vllm_kvreuse.config import KVReuseConfig

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
    seen: list[list[list[int]]],
    segments: list[list[int]],
    settings: Recompute,
    recompute: object = None,
) -> torch.Tensor:
    """The engine's answer to ``segments`` (after ``seen``) equals the
    reference's; returns the reference's first-step log-probs."""
    expected, logprobs = stored_reference(hf_model, seen, segments, STEPS, settings)
    out = generate(llm, segments, max_tokens=STEPS, recompute=recompute)
    assert list(out.outputs[0].token_ids) == expected
    tolerance = reference_tolerance(llm, hf_model)
    for token, entry in out.outputs[0].logprobs[0].items():
        assert abs(entry.logprob - float(logprobs[token])) < tolerance
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
    """Cold (every chunk computed in place) equals full attention; warm in
    another order equals the reference: moved chunks loaded with their
    recomputed spans, the question after them; the pool is back where it
    started."""
    with chunk_cache_llm(model_dir, **flags) as llm:
        free = num_free_blocks(llm)
        cold = [SYSTEM, DOC_A, DOC_B, ABOUT_B]
        _check(llm, hf_model, [], cold, settings)
        hits = index_of(llm).stats.hit_tokens
        warm = [SYSTEM, DOC_B, DOC_A, ABOUT_B]
        assert expected_spans(warm, sources_after([cold], warm), settings)
        _check(llm, hf_model, [cold], warm, settings)
        assert index_of(llm).stats.hit_tokens > hits
        assert num_free_blocks(llm) == free


def test_a_segmented_request_sent_again_hits_the_prefix_cache(
    model_dir: str, hf_model
) -> None:
    """Its blocks (loaded and recomputed) are hashed under a salt naming
    their values: the same request finds them all."""
    with chunk_cache_llm(model_dir, chunk_recompute_head=8) as llm:
        generate(llm, [SYSTEM, DOC_A, DOC_B, QUESTION])
        segments = [SYSTEM, DOC_B, DOC_A, QUESTION]
        first = generate(llm, segments)
        again = generate(llm, segments)
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        total = len(SYSTEM + DOC_A + DOC_B + QUESTION)
        assert again.num_cached_tokens >= total - total % BLOCK_SIZE - BLOCK_SIZE
        assert not scheduler_of(llm).connector.scheduler_side.plans


def test_the_default_settings_match_the_hf_reference(model_dir: str, hf_model) -> None:
    """``--enable-chunk-cache`` alone recomputes what its defaults say
    (docs/results/chunk_cache.md: the setting that keeps answers)."""
    defaults = KVReuseConfig()
    settings = Recompute(
        head=defaults.chunk_recompute_head,
        select=defaults.chunk_recompute_select,
        tail=defaults.chunk_recompute_fraction,
    )
    with chunk_cache_llm(model_dir, **DEFAULTS) as llm:
        cold = [SYSTEM, DOC_A, DOC_B, ABOUT_B]
        _check(llm, hf_model, [], cold, settings)
        _check(llm, hf_model, [cold], [SYSTEM, DOC_B, DOC_A, ABOUT_B], settings)


def test_a_request_may_ask_for_no_recompute(model_dir: str, hf_model) -> None:
    """``chunk_recompute: "none"`` loads every stored chunk whatever the
    server's settings (the fastest setting), as the reference says."""
    with chunk_cache_llm(model_dir, chunk_recompute_head=8) as llm:
        cold = [SYSTEM, DOC_A, DOC_B, QUESTION]
        generate(llm, cold, recompute="none")
        warm = [SYSTEM, DOC_B, DOC_A, QUESTION]  # every chunk stored
        _check(llm, hf_model, [cold], warm, Recompute(), recompute="none")
        full, _ = full_attention(hf_model, warm, STEPS)
        out = generate(llm, warm, recompute="none")
        assert list(out.outputs[0].token_ids) != full, "the reuse must show"
        assert out.num_cached_tokens >= len(SYSTEM + DOC_A + DOC_B) - BLOCK_SIZE


def test_a_partly_warm_request_loads_and_computes_in_place(
    model_dir: str, hf_model
) -> None:
    """One stored document moved, a new one computed after it (with heads
    and a tail recomputed in the moved one); the new one is stored as
    computed there: a request repeating the same prompt loads it in context,
    with nothing of it recomputed, and answers the same."""
    settings = Recompute(head=8, tail=0.1)
    flags = {"chunk_recompute_head": 8, "chunk_recompute_fraction": 0.1}
    with chunk_cache_llm(model_dir, **flags) as llm:
        free = num_free_blocks(llm)
        cold = [SYSTEM, DOC_A, QUESTION]
        generate(llm, cold)
        warm = [SYSTEM, DOC_B, DOC_A, ABOUT_B]
        warm_again = [SYSTEM, DOC_B, DOC_A, QUESTION]
        _check(llm, hf_model, [cold], warm, settings)
        stats = index_of(llm).stats
        exact = stats.exact_hits
        llm.reset_prefix_cache()
        again = generate(llm, warm_again)
        assert stats.exact_hits - exact == 2  # SYSTEM and DOC_B, in context
        chunk_tokens = sum(chunked_prompt(warm_again)[1])
        # DOC_A is still moved: its head and the tail are recomputed again.
        recomputed = 8 + round(0.1 * chunk_tokens)
        assert again.num_cached_tokens == chunk_tokens - recomputed
        assert num_free_blocks(llm) == free


LONG_DOCS = [list(range(1000 + 200 * i, 1150 + 200 * i)) for i in range(4)]


def test_a_warm_request_reaches_its_first_token_in_one_step(
    model_dir: str, hf_model
) -> None:
    """Four moved documents with the default recompute: every region loaded
    and every recomputed span computed in one engine step (as rows of it),
    as many steps as a plain prefix hit takes, and the reference's answer;
    with one seat there are no rows to lend: one span a step, same answer."""
    defaults = KVReuseConfig()
    settings = Recompute(
        head=defaults.chunk_recompute_head,
        select=defaults.chunk_recompute_select,
        tail=defaults.chunk_recompute_fraction,
    )
    cold = [SYSTEM, *LONG_DOCS, QUESTION]
    warm = [SYSTEM, *reversed(LONG_DOCS), QUESTION]
    assert len(expected_spans(warm, sources_after([cold], warm), settings)) == 5
    answers = []
    for seats in (8, 1):
        with chunk_cache_llm(model_dir, max_num_seqs=seats, **DEFAULTS) as llm:
            first = generate(llm, cold)
            assert first.kv_transfer_params[PREFILL_STEPS] == 1  # first sight
            _check(llm, hf_model, [cold], warm, settings)
            llm.reset_prefix_cache()  # the chunks stay stored
            hits = index_of(llm).stats.hits
            out = generate(llm, warm)
            assert index_of(llm).stats.hits == hits + 5
            steps = out.kv_transfer_params[PREFILL_STEPS]
            assert steps == 1 if seats > 1 else steps == 5
            again = generate(llm, warm)  # a plain prefix hit
            assert again.kv_transfer_params[PREFILL_STEPS] == 1
            assert again.outputs[0].token_ids == out.outputs[0].token_ids
            answers.append(out.outputs[0])
            stats = index_of(llm).stats
            assert stats.prefilled == 4
    one_step, by_span = answers
    assert one_step.token_ids == by_span.token_ids
    for step, span in zip(one_step.logprobs, by_span.logprobs, strict=True):
        for token, entry in step.items():
            assert abs(entry.logprob - span[token].logprob) < 1e-3
