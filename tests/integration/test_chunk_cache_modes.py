"""Chunk-cache engine settings other than the default, one engine per test
(vLLM allows one chunk-cache engine per process at a time)."""

from __future__ import annotations

from vllm import SamplingParams

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
from tests.integration.conftest import num_free_blocks
from vllm_kvreuse.chunk_cache.frontend import chunked_prompt


def test_system_mode_matches_the_hf_reference(model_dir: str, hf_model) -> None:
    """Chunks computed after the system prompt (virtual positions from its
    length), reused after the same system prompt in another order."""
    with chunk_cache_llm(model_dir, chunk_attention="system") as llm:
        free = num_free_blocks(llm)
        generate(llm, [SYSTEM, DOC_A, DOC_B, QUESTION])
        segments = [SYSTEM, DOC_B, DOC_A, QUESTION]
        expected, _ = hf_reference(hf_model, segments, steps=6, see_system=True)
        out = generate(llm, segments)
        assert list(out.outputs[0].token_ids) == expected
        assert out.num_cached_tokens >= len(SYSTEM + DOC_A + DOC_B) - BLOCK_SIZE
        assert num_free_blocks(llm) == free


def test_a_chunk_the_store_cannot_take_runs_as_an_ordinary_request(
    model_dir: str,
) -> None:
    with chunk_cache_llm(model_dir, chunk_cache_device_fraction=1e-6) as llm:
        free = num_free_blocks(llm)
        segments = [SYSTEM, DOC_A, QUESTION]
        out = generate(llm, segments)
        token_ids, _ = chunked_prompt(segments)
        plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        (expected,) = llm.generate([{"prompt_token_ids": token_ids}], plain)
        assert out.outputs[0].token_ids == expected.outputs[0].token_ids
        assert index_of(llm).stats.degraded == 1
        assert index_of(llm).stats.refused >= 1
        assert num_free_blocks(llm) == free


def test_chunks_demoted_to_the_cpu_tier_are_loaded_from_it(
    model_dir: str,
    hf_model,
) -> None:
    """A device tier of ~170 tokens: a third request's document comes back
    from the CPU tier, where the second request's arrival demoted it."""
    with chunk_cache_llm(model_dir, chunk_cache_cpu_gib=0.01) as llm:
        index = index_of(llm)
        # Shrink the device tier in place: the flag is a fraction of the KV
        # pool, far more than a test's chunks.
        index.capacity["device"] = 170 * index.bytes_per_token
        doc_c = list(range(500, 570))
        generate(llm, [SYSTEM, DOC_A, QUESTION])
        generate(llm, [SYSTEM, doc_c, QUESTION])
        assert index.bytes_in("cpu") == len(DOC_A) * index.bytes_per_token
        segments = [SYSTEM, DOC_A, QUESTION]
        expected, _ = hf_reference(hf_model, segments, steps=6)
        hits = index.stats.hit_tokens
        out = generate(llm, segments)
        assert list(out.outputs[0].token_ids) == expected
        assert index.stats.hit_tokens - hits == len(SYSTEM) + len(DOC_A)


def test_a_recomputed_tail_matches_the_hf_reference(model_dir: str, hf_model) -> None:
    """--chunk-recompute-fraction 0.25: the chunks' last quarter is prefilled
    with the question (full attention), the rest loaded from the store."""
    with chunk_cache_llm(model_dir, chunk_recompute_fraction=0.25) as llm:
        free = num_free_blocks(llm)
        generate(llm, [SYSTEM, DOC_A, DOC_B, QUESTION])  # stores every chunk
        segments = [SYSTEM, DOC_B, DOC_A, QUESTION]
        chunk_tokens = len(SYSTEM + DOC_B + DOC_A)
        load_end = chunk_tokens - round(0.25 * chunk_tokens)  # inside DOC_A
        assert len(SYSTEM + DOC_B) < load_end < chunk_tokens
        expected, logprobs = hf_reference(hf_model, segments, 6, full_from=load_end)
        out = generate(llm, segments)
        assert list(out.outputs[0].token_ids) == expected
        first = out.outputs[0].logprobs[0]
        for token, entry in first.items():
            assert abs(entry.logprob - float(logprobs[token])) < 1e-3
        # Only [0, load_end) came from the store; the other order's blocks
        # are hashed under other segment lengths, so no prefix-cache hit.
        assert out.num_cached_tokens == load_end
        assert index_of(llm).stats.hit_tokens == load_end
        assert num_free_blocks(llm) == free
