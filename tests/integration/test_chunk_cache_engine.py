"""The chunk cache through a real vLLM engine (offline LLM API), checked
against Hugging Face transformers: full attention for a request whose chunks
are new, and each stored chunk as computed where it was first seen (moved by
RoPE) for a request that reuses it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from vllm import LLM, SamplingParams
from vllm.distributed.kv_transfer import get_kv_transfer_group

from tests.conftest import BLOCK_SIZE, ENGINE_KWARGS
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
from tests.integration.conftest import reference_tolerance, scheduler_of
from vllm_kvreuse.chunk_cache.frontend.segments import chunked_prompt
from vllm_kvreuse.core.request_keys import CHUNKS, seal

pytestmark = pytest.mark.usefixtures("no_leak")
PLAIN = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)


def doc(first: int, length: int = 60) -> list[int]:
    """A document no other test of the module sends (each test starts from
    a store whose state for its documents is known)."""
    return list(range(first, first + length))


@pytest.fixture(scope="module")
def llm(model_dir: str) -> Iterator[LLM]:
    with chunk_cache_llm(
        model_dir, enable_continuation=True, global_cache_hit_threshold=0.0
    ) as engine:
        yield engine


@pytest.fixture(scope="module")
def tolerance(llm, hf_model) -> float:
    """Of comparisons with the Hugging Face reference on this device
    (:func:`~tests.integration.conftest.reference_tolerance`)."""
    return reference_tolerance(llm, hf_model)


def _assert_matches(out, expected: list[int], logprobs, tolerance: float) -> None:
    assert list(out.outputs[0].token_ids) == expected
    for token, entry in out.outputs[0].logprobs[0].items():
        assert entry.logprob == pytest.approx(float(logprobs[token]), abs=tolerance)


def _largest_difference(a, b) -> float:
    """The largest log-prob difference of two answers with equal tokens,
    over every step's top log-probs."""
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    steps = zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True)
    return max(abs(x[t].logprob - y[t].logprob) for x, y in steps for t in x)


def test_a_request_of_new_chunks_is_computed_as_plain_vllm(
    llm, hf_model, tolerance
) -> None:
    """First sight: every chunk computed in place, in the request itself (no
    other request runs), equal to an ordinary request of the same tokens and
    to full attention; its chunks are stored."""
    segments = [SYSTEM, DOC_A, DOC_B, QUESTION]
    token_ids, _ = chunked_prompt(segments)
    stats = index_of(llm).stats
    saved = stats.saved
    cold = generate(llm, segments)
    assert stats.saved - saved == 3
    assert cold.num_cached_tokens == 0
    expected, logprobs = full_attention(hf_model, segments, steps=6)
    _assert_matches(cold, expected, logprobs, tolerance)
    llm.reset_prefix_cache()
    (plain,) = llm.generate([{"prompt_token_ids": token_ids}], PLAIN)
    assert plain.outputs[0].token_ids == cold.outputs[0].token_ids
    assert not scheduler_of(llm).requests


def test_its_blocks_are_shared_with_ordinary_requests(llm) -> None:
    """A request that computed or loaded only full attention's KV keeps its
    own salt: an ordinary request with its tokens hits its blocks."""
    first, second = doc(1500), doc(1600)
    segments = [SYSTEM, first, second, QUESTION]
    token_ids, _ = chunked_prompt(segments)
    generate(llm, [SYSTEM, first, QUESTION])
    chunked = generate(llm, segments)  # SYSTEM, first stored after what precedes
    (plain,) = llm.generate([{"prompt_token_ids": token_ids}], PLAIN)
    assert plain.num_cached_tokens == len(token_ids) // BLOCK_SIZE * BLOCK_SIZE
    assert plain.outputs[0].token_ids == chunked.outputs[0].token_ids


def test_the_same_chunks_again_load_what_was_stored(
    llm, hf_model, tolerance, record_property
) -> None:
    """Same documents, same order, another question: every chunk is loaded
    as stored, where it was computed. vLLM's prefix cache gives the same
    prompt the same KV (computed by the same first prompt), so the answers
    agree to within what vLLM itself differs by between a prefix hit and the
    prompt computed whole (the device's rounding: 0 or near it; measured 0
    on an H200). On a CPU both are also full attention's answer; a GPU's
    own rounding puts vLLM up to 4.5e-3 from that reference (float32,
    H200), so there vLLM is the reference."""
    documents = [doc(1700, 70), doc(1800, 50)]
    first = [SYSTEM, *documents, QUESTION]
    generate(llm, first)
    llm.reset_prefix_cache()  # the blocks go; the stored chunks stay
    stats = index_of(llm).stats
    hits, exact = stats.hit_tokens, stats.exact_hits
    segments = [SYSTEM, *documents, [7, 8, 9, *QUESTION]]
    out = generate(llm, segments)
    chunk_tokens = len(SYSTEM) + 120
    assert stats.hit_tokens - hits == chunk_tokens
    assert stats.exact_hits - exact == 3
    assert out.num_cached_tokens == chunk_tokens

    # Plain vLLM, same engine and device: a prefix hit, and computed whole.
    ids = [{"prompt_token_ids": chunked_prompt(s)[0]} for s in (first, segments)]
    llm.reset_prefix_cache()
    llm.generate(ids[:1], PLAIN, use_tqdm=False)
    (hit,) = llm.generate(ids[1:], PLAIN, use_tqdm=False)
    assert hit.num_cached_tokens == chunk_tokens
    llm.reset_prefix_cache()
    (whole,) = llm.generate(ids[1:], PLAIN, use_tqdm=False)
    loaded, rounding = _largest_difference(out, hit), _largest_difference(hit, whole)
    record_property("chunk load vs vLLM prefix hit (max log-prob diff)", loaded)
    record_property("vLLM prefix hit vs computed whole (max log-prob diff)", rounding)
    assert loaded <= max(rounding, 1e-6)
    if not torch.cuda.is_available():  # a GPU rounds differently from the CPU's
        expected, logprobs = full_attention(hf_model, segments, steps=6)
        _assert_matches(out, expected, logprobs, tolerance)


def test_chunks_are_reused_in_new_company_and_new_ones_computed_in_place(
    llm, hf_model, tolerance
) -> None:
    """A new system prompt, a stored document, a new one, another stored one:
    the stored ones are loaded as computed where first seen (moved by RoPE),
    the new ones computed in place after them, and stored."""
    doc_a, doc_b, doc_d = doc(1900, 90), doc(2000, 33), doc(2100, 80)
    seen = [[SYSTEM, doc_a, doc_b, QUESTION]]
    generate(llm, seen[0])
    segments = [list(range(600, 620)), doc_b, doc_d, doc_a, QUESTION]
    expected, logprobs = stored_reference(hf_model, seen, segments, steps=6)
    full, _ = full_attention(hf_model, segments, steps=6)
    assert expected != full, "the reuse must show in the answer"
    stats = index_of(llm).stats
    hits, saved = stats.hit_tokens, stats.saved
    out = generate(llm, segments)
    _assert_matches(out, expected, logprobs, tolerance)
    assert stats.hit_tokens - hits == len(doc_b + doc_a)
    assert stats.saved - saved == 2  # the new system prompt and doc_d
    assert out.num_cached_tokens == len(doc_b + doc_a)


def test_a_request_with_moved_chunks_never_matches_an_ordinary_one(llm) -> None:
    """Its blocks hold values full attention does not compute: an ordinary
    request with the same tokens finds none of them after the first chunk's
    position, and answers as on an empty cache."""
    doc_a, doc_b = doc(2200, 70), doc(2300, 45)
    generate(llm, [SYSTEM, doc_a, doc_b, QUESTION])
    segments = [SYSTEM, doc_b, doc_a, QUESTION]
    token_ids, _ = chunked_prompt(segments)
    generate(llm, segments)
    (plain,) = llm.generate([{"prompt_token_ids": token_ids}], PLAIN)
    assert plain.num_cached_tokens <= len(SYSTEM)
    llm.reset_prefix_cache()
    (fresh,) = llm.generate([{"prompt_token_ids": token_ids}], PLAIN)
    assert plain.outputs[0].token_ids == fresh.outputs[0].token_ids


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


def test_concurrent_requests_with_a_new_chunk_both_compute_it(llm) -> None:
    """Two requests arriving together, both bringing DOC_D: neither waits for
    the other; one stores it."""
    doc_d = doc(2400)
    stats = index_of(llm).stats
    misses, saved = stats.misses, stats.saved
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
    assert stats.misses - misses in (2, 4)  # and SYSTEM, if not stored before
    assert stats.saved - saved in (1, 2)
    assert index_of(llm).get(index_key(llm, doc_d)) is not None


def index_key(llm: LLM, tokens: list[int]) -> bytes:
    return scheduler_of(llm).connector.scheduler_side.store.key(None, "", tokens)


def test_stored_chunks_count_as_hits_for_the_cache_threshold(llm) -> None:
    segments = [doc(3200, 40), doc(3300, 90), list(range(30, 40))]
    token_ids, lengths = chunked_prompt(segments)

    def ask(threshold: float | None):
        extra_args = seal({CHUNKS: lengths})
        if threshold is not None:
            extra_args["cache_hit_threshold"] = threshold
        params = SamplingParams(
            max_tokens=2, temperature=0.0, ignore_eos=True, extra_args=extra_args
        )
        (out,) = llm.generate([{"prompt_token_ids": token_ids}], params)
        llm.reset_prefix_cache()  # hits from the store, not the prefix cache
        return out.outputs[0].finish_reason

    assert ask(0.5) == "cache_threshold"  # cold: its chunks are not stored
    assert ask(0.5) == "cache_threshold"  # a rejected request stores nothing
    assert ask(None) == "length"  # computes and stores them
    # 130 of its 140 tokens are stored chunks.
    assert ask(0.9) == "length"
    assert ask(0.95) == "cache_threshold"


def test_abort_before_a_chunk_is_saved_frees_everything(llm, hf_model) -> None:
    """A request aborted before its first step: its reservations and pins
    go back, and the next request computes and stores the chunk."""
    segments = [SYSTEM, doc(2500, 90), QUESTION]
    token_ids, lengths = chunked_prompt(segments)
    params = SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True,
        extra_args=seal({CHUNKS: lengths}),
    )  # fmt: skip
    engine = llm.llm_engine
    engine.add_request("aborted", {"prompt_token_ids": token_ids}, params)
    engine.abort_request(["aborted"])
    while engine.has_unfinished_requests():
        engine.step()
    index = index_of(llm)
    assert all(entry.ready and not entry.pins for entry in index.entries.values())
    expected, _ = full_attention(hf_model, segments, steps=4)
    out = generate(llm, segments, max_tokens=4)
    assert list(out.outputs[0].token_ids) == expected


@pytest.mark.parametrize("reordered", [False, True], ids=["new", "reordered"])
def test_a_continuation_of_a_chunked_request_inherits_its_blocks(
    llm, hf_model, reordered: bool
) -> None:
    """The child keeps the parent's chunks and is planned to the same values
    (same salt), so it inherits the parent's blocks, and it answers as the
    parent would with its output and the suffix appended to the question."""
    new, other = doc(2600 + 200 * reordered), doc(2700 + 200 * reordered, 40)
    seen = [[SYSTEM, other, new, QUESTION]] if reordered else []
    for prompt in seen:
        generate(llm, prompt)
    segments = [SYSTEM, new, other, QUESTION] if reordered else [SYSTEM, new, QUESTION]
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
    expected, _ = stored_reference(hf_model, seen, [*segments[:-1], question], 4)
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
        generate(llm, [SYSTEM, doc(3100, 50), QUESTION], max_tokens=2)
        assert layer_calls, "a step that saves or loads a chunk is bound"
    finally:
        del connector.wait_for_layer_load
