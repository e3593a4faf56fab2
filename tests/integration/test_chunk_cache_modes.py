"""Chunk-cache engine settings other than the default, one engine per test
(vLLM allows one chunk-cache engine per process at a time)."""

from __future__ import annotations

from vllm import SamplingParams

from tests.integration.chunks import (
    DOC_A,
    DOC_B,
    QUESTION,
    SYSTEM,
    chunk_cache_llm,
    full_attention,
    generate,
    index_of,
    stored_reference,
)
from tests.integration.conftest import num_free_blocks, scheduler_of
from vllm_kvreuse.chunk_cache.engine.recompute import Recompute
from vllm_kvreuse.chunk_cache.frontend.segments import chunked_prompt


def test_a_chunk_the_store_cannot_take_is_only_computed(model_dir: str) -> None:
    """A store too small for any chunk: the request is computed in place as
    plain vLLM computes it, and nothing is stored or left reserved."""
    with chunk_cache_llm(model_dir, chunk_cache_device_fraction=1e-6) as llm:
        free = num_free_blocks(llm)
        segments = [SYSTEM, DOC_A, QUESTION]
        out = generate(llm, segments)
        token_ids, _ = chunked_prompt(segments)
        plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        (expected,) = llm.generate([{"prompt_token_ids": token_ids}], plain)
        assert out.outputs[0].token_ids == expected.outputs[0].token_ids
        assert index_of(llm).stats.refused == 2
        assert not index_of(llm).entries
        assert not scheduler_of(llm).connector.scheduler_side.plans
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
        expected, _ = full_attention(hf_model, segments, steps=6)
        hits = index.stats.hit_tokens
        llm.reset_prefix_cache()  # loaded from the store, not the prefix cache
        out = generate(llm, segments)
        assert list(out.outputs[0].token_ids) == expected
        assert index.stats.hit_tokens - hits == len(SYSTEM) + len(DOC_A)
        assert out.num_cached_tokens == len(SYSTEM) + len(DOC_A)


def test_a_recomputed_tail_matches_the_hf_reference(model_dir: str, hf_model) -> None:
    """--chunk-recompute-fraction 0.25: the chunks' last quarter is prefilled
    with the question (full attention), the rest loaded from the store."""
    with chunk_cache_llm(model_dir, chunk_recompute_fraction=0.25) as llm:
        free = num_free_blocks(llm)
        cold = [SYSTEM, DOC_A, DOC_B, QUESTION]
        generate(llm, cold)  # stores every chunk
        segments = [SYSTEM, DOC_B, DOC_A, QUESTION]
        chunk_tokens = len(SYSTEM + DOC_B + DOC_A)
        load_end = chunk_tokens - round(0.25 * chunk_tokens)  # inside DOC_A
        assert len(SYSTEM + DOC_B) < load_end < chunk_tokens
        expected, logprobs = stored_reference(
            hf_model, [cold], segments, 6, Recompute(tail=0.25)
        )
        out = generate(llm, segments)
        assert list(out.outputs[0].token_ids) == expected
        first = out.outputs[0].logprobs[0]
        for token, entry in first.items():
            assert abs(entry.logprob - float(logprobs[token])) < 1e-3
        # Only [0, load_end) came from the store; the other order's blocks
        # are hashed under another salt, so only the system prompt's full
        # block could come from the prefix cache.
        assert out.num_cached_tokens == load_end
        assert num_free_blocks(llm) == free
