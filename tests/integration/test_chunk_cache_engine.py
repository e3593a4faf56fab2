"""The chunk cache through a real vLLM engine (offline LLM API), checked
against Hugging Face transformers run with an explicit chunk-isolated mask."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vllm import LLM, SamplingParams
from vllm.distributed.kv_transfer import get_kv_transfer_group

from tests.conftest import ENGINE_KWARGS
from tests.integration.chunks import (
    DOC_A,
    DOC_B,
    DOC_C,
    QUESTION,
    SYSTEM,
    chunk_cache_llm,
    generate,
    hf_reference,
    index_of,
)
from vllm_kvreuse.chunk_cache.frontend import chunked_prompt
from vllm_kvreuse.core.request_keys import CHUNKS, seal

pytestmark = pytest.mark.usefixtures("no_leak")


@pytest.fixture(scope="module")
def llm(model_dir: str) -> Iterator[LLM]:
    with chunk_cache_llm(
        model_dir, enable_continuation=True, global_cache_hit_threshold=0.0
    ) as engine:
        yield engine


def test_cold_and_warm_match_the_hf_chunk_isolated_reference(llm, hf_model) -> None:
    segments = [SYSTEM, DOC_A, DOC_B, QUESTION]
    expected, logprobs = hf_reference(hf_model, segments, steps=6)
    cold = generate(llm, segments)
    warm = generate(llm, segments)
    assert list(cold.outputs[0].token_ids) == expected
    assert cold.num_cached_tokens == 0  # its chunks were computed by its fills
    assert warm.num_cached_tokens == len(SYSTEM + DOC_A + DOC_B)
    assert list(warm.outputs[0].token_ids) == expected
    for out in (cold, warm):
        for token, logprob in out.outputs[0].logprobs[0].items():
            assert logprob.logprob == pytest.approx(float(logprobs[token]), abs=1e-3)


def test_chunks_are_reused_at_other_positions(llm, hf_model) -> None:
    """Swapped documents after a new system prompt: every cached chunk is reused
    wherever it stands (keys re-rotated), and the answer is still the
    reference's."""
    generate(llm, [SYSTEM, DOC_A, DOC_C, QUESTION])  # caches DOC_C
    stats = index_of(llm).stats
    hits_before = stats.hit_tokens
    segments = [list(range(600, 620)), DOC_C, DOC_A, QUESTION]
    expected, _ = hf_reference(hf_model, segments, steps=6)
    out = generate(llm, segments)
    assert list(out.outputs[0].token_ids) == expected
    assert stats.hit_tokens - hits_before == len(DOC_C) + len(DOC_A)
    assert out.num_cached_tokens >= len(DOC_C) + len(DOC_A)


def test_chunked_blocks_never_match_an_ordinary_request(llm) -> None:
    """An ordinary request with the same tokens gets full-attention KV: its
    output is the plain model's (as with an empty cache), not the chunked
    one's."""
    segments = [SYSTEM, DOC_B, DOC_A, QUESTION]
    token_ids, _ = chunked_prompt(segments)
    chunked = generate(llm, segments, max_tokens=8)
    plain_params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (plain,) = llm.generate([{"prompt_token_ids": token_ids}], plain_params)
    (fresh,) = make_llm_free_plain(llm, token_ids, plain_params)
    # The system prompt's fill is ordinary KV of a prompt prefix (no
    # isolation needed at the start), so only its full block may match.
    assert plain.num_cached_tokens <= len(SYSTEM)
    assert list(plain.outputs[0].token_ids) == list(fresh.outputs[0].token_ids)
    assert list(chunked.outputs[0].token_ids) != list(plain.outputs[0].token_ids)


def make_llm_free_plain(llm: LLM, token_ids: list[int], params: SamplingParams):
    """The same ordinary request again, after clearing the prefix cache."""
    llm.reset_prefix_cache()
    return llm.generate([{"prompt_token_ids": token_ids}], params)


def test_prompt_token_ids_are_the_concatenated_segments(llm) -> None:
    segments = [SYSTEM, DOC_A, QUESTION]
    out = generate(llm, segments, max_tokens=1)
    assert list(out.prompt_token_ids) == SYSTEM + DOC_A + QUESTION


def test_bad_lengths_run_as_an_ordinary_request(llm) -> None:
    token_ids = SYSTEM + QUESTION
    params = SamplingParams(
        max_tokens=3, temperature=0.0, ignore_eos=True,
        extra_args=seal({CHUNKS: [len(token_ids)]}),  # no question left
    )  # fmt: skip
    (out,) = llm.generate([{"prompt_token_ids": token_ids}], params)
    plain = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    (expected,) = llm.generate([{"prompt_token_ids": token_ids}], plain)
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids


def test_concurrent_requests_share_one_fill_per_chunk(llm) -> None:
    """Two requests arriving together, both missing DOC_D: one fill."""
    doc_d = list(range(700, 760))
    stats = index_of(llm).stats
    misses, miss_tokens = stats.misses, stats.miss_tokens
    token_a, lengths_a = chunked_prompt([SYSTEM, doc_d, [5, 6, 7]])
    token_b, lengths_b = chunked_prompt([SYSTEM, doc_d, [8, 9, 10, 11]])
    params = [
        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                       extra_args=seal({CHUNKS: lengths}))
        for lengths in (lengths_a, lengths_b)
    ]  # fmt: skip
    outs = llm.generate(
        [{"prompt_token_ids": token_a}, {"prompt_token_ids": token_b}], params
    )
    assert all(len(out.outputs[0].token_ids) == 2 for out in outs)
    # DOC_D once (and SYSTEM once, if no earlier test stored it).
    new_tokens = stats.miss_tokens - miss_tokens
    assert new_tokens in (len(doc_d), len(doc_d) + len(SYSTEM))
    assert stats.misses - misses == (1 if new_tokens == len(doc_d) else 2)


def test_stored_chunks_count_as_hits_for_the_cache_threshold(llm) -> None:
    segments = [list(range(800, 840)), list(range(900, 990)), list(range(30, 40))]
    token_ids, lengths = chunked_prompt(segments)

    def ask(threshold: float):
        params = SamplingParams(
            max_tokens=2, temperature=0.0, ignore_eos=True,
            extra_args={
                **seal({CHUNKS: lengths}),
                "cache_hit_threshold": threshold,
            },
        )  # fmt: skip
        (out,) = llm.generate([{"prompt_token_ids": token_ids}], params)
        return out.outputs[0].finish_reason

    assert ask(0.5) == "cache_threshold"  # cold: its chunks are not stored
    # The rejected request's fills still ran (documented), so a retry hits:
    # 130 of its 140 tokens are stored chunks.
    assert ask(0.9) == "length"
    assert ask(0.95) == "cache_threshold"


def test_abort_while_waiting_for_chunks_frees_everything(llm, hf_model) -> None:
    """A request parked for its chunks' fills is aborted: its blocks and pins
    go back, the fills finish, and the next request is still correct."""
    segments = [SYSTEM, list(range(1200, 1290)), QUESTION]
    token_ids, lengths = chunked_prompt(segments)
    params = SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True,
        extra_args=seal({CHUNKS: lengths}),
    )  # fmt: skip
    engine = llm.llm_engine
    engine.add_request("parked", {"prompt_token_ids": token_ids}, params)
    engine.step()  # the fills run; the request waits for its chunks
    engine.abort_request(["parked"])
    while engine.has_unfinished_requests():
        engine.step()
    assert not index_of(llm).entries or all(
        not entry.pins for entry in index_of(llm).entries.values()
    )
    expected, _ = hf_reference(hf_model, segments, steps=4)
    out = generate(llm, segments, max_tokens=4)
    assert list(out.outputs[0].token_ids) == expected


def test_a_continuation_of_a_chunked_request_inherits_its_blocks(llm, hf_model) -> None:
    """The child keeps the parent's chunks (same salt), so it inherits the
    parent's blocks, and it answers as the chunk-isolated reference does with
    the parent's output and the suffix appended to the question."""
    segments = [SYSTEM, list(range(1300, 1360)), QUESTION]
    token_ids, lengths = chunked_prompt(segments)
    params = SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True,
        extra_args={**seal({CHUNKS: lengths}), "retain_kv": True},
    )  # fmt: skip
    (parent,) = llm.generate([{"prompt_token_ids": token_ids}], params)
    suffix = [11, 12, 13]
    child = llm.generate_continuation(
        parent.request_id,
        suffix,
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    )
    parent_tokens = list(parent.outputs[0].token_ids)
    question = QUESTION + parent_tokens + suffix
    expected, _ = hf_reference(hf_model, [*segments[:-1], question], steps=4)
    assert list(child.outputs[0].token_ids) == expected
    inherited = len(token_ids) + len(parent_tokens) - 1  # all but its last token
    assert child.num_cached_tokens >= inherited
    llm.reset_prefix_cache()  # releases the retained parent


@pytest.mark.skipif(
    ENGINE_KWARGS.get("tensor_parallel_size", 1) > 1,
    reason="reads the worker's connector, in worker processes under TP",
)
def test_steps_without_chunk_work_make_no_per_layer_call(llm) -> None:
    """vLLM calls the connector per attention layer only while step metadata
    is bound; the worker binds only steps that load or save a chunk."""
    connector = get_kv_transfer_group()
    layer_calls: list[str] = []
    connector.wait_for_layer_load = layer_calls.append  # counts, on this object
    try:
        plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": list(range(40, 140))}], plain)
        assert layer_calls == []
        generate(llm, [SYSTEM, list(range(1400, 1450)), QUESTION], max_tokens=2)
        assert layer_calls, "a step that saves or loads a chunk is bound"
    finally:
        del connector.wait_for_layer_load
