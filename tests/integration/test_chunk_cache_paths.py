"""``--chunk-attention paths``: a chunked request is answered on the path
(system prompt + one document + question) that makes its question likeliest.

The reference is vLLM's own loop: each path run as an ordinary request with
prompt log-probs, the likeliest chosen, and that path's greedy answer.
"""

from __future__ import annotations

import math

from vllm import LLM, SamplingParams

from tests.integration.chunks import (
    DOC_A,
    DOC_B,
    DOC_C,
    QUESTION,
    SYSTEM,
    chunk_cache_llm,
    generate,
    stored_reference,
)
from tests.integration.conftest import num_free_blocks, scheduler_of
from vllm_kvreuse.chunk_cache.engine.said import DOCUMENTS_KEPT, PATHS_CAPPED
from vllm_kvreuse.chunk_cache.frontend.segments import chunked_prompt
from vllm_kvreuse.core.request_keys import CHUNKS, seal

DOCS = (DOC_A, DOC_B, DOC_C)


def _question_logprob(llm: LLM, doc: list[int]) -> float:
    """Log-likelihood of QUESTION after its first token, on ``doc``'s path."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    (out,) = llm.generate(
        [{"prompt_token_ids": SYSTEM + doc + QUESTION}], params, use_tqdm=False
    )
    start = len(SYSTEM) + len(doc) + 1
    rows = out.prompt_logprobs[start:]
    tokens = out.prompt_token_ids[start:]
    return sum(row[token].logprob for row, token in zip(rows, tokens, strict=True))


def _answer(llm: LLM, prompt: list[int]) -> list[int]:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return list(out.outputs[0].token_ids)


def test_a_request_is_answered_on_its_likeliest_path(model_dir: str) -> None:
    """Cold and reordered: the answer is the likeliest path's, as an ordinary
    request on that path answers; a reorder finds its documents' prefixes
    in vLLM's prefix cache; every scoring request's blocks come back."""
    with chunk_cache_llm(model_dir, chunk_attention="paths") as llm:
        free = num_free_blocks(llm)
        voting = scheduler_of(llm).feature("chunk_cache").voting
        out = generate(llm, [SYSTEM, *DOCS, QUESTION])
        assert voting.num_decided == 1
        assert not voting.ballots.by_request
        reordered = generate(llm, [SYSTEM, DOC_C, DOC_A, DOC_B, QUESTION])
        assert voting.num_decided == 2
        # Whole blocks of system + document: cached by the first request's
        # scoring requests (the 32-token block is the tests' block size).
        assert reordered.num_cached_tokens >= 32
        llm.reset_prefix_cache()
        scores = [_question_logprob(llm, doc) for doc in DOCS]
        assert all(math.isfinite(score) for score in scores)
        best = max(range(len(DOCS)), key=lambda i: (scores[i], -i))
        # Not a near tie, so float noise between runs cannot flip the choice.
        assert scores[best] - sorted(scores)[-2] > 0.1
        expected = _answer(llm, SYSTEM + DOCS[best] + QUESTION)
        assert list(out.outputs[0].token_ids) == expected
        assert list(reordered.outputs[0].token_ids) == expected
        assert num_free_blocks(llm) == free


def test_paths_per_request_and_where_they_do_not_apply(model_dir: str) -> None:
    """A request's ``chunk_attention`` field picks paths on a joint server;
    one document, or prompt log-probs asked for, run jointly."""
    with chunk_cache_llm(model_dir) as llm:
        voting = scheduler_of(llm).feature("chunk_cache").voting
        generate(llm, [SYSTEM, DOC_A, DOC_B, QUESTION])
        assert voting.num_decided == 0
        out = generate(llm, [SYSTEM, DOC_A, DOC_B, QUESTION], attention="paths")
        assert voting.num_decided == 1
        assert out.outputs[0].token_ids
        for attention in ("paths", "choose"):  # one document: nothing to choose
            out = generate(llm, [SYSTEM, DOC_A, QUESTION], attention=attention)
            assert voting.num_decided == 1
            # an ordinary prompt: vLLM's own answer, token for token
            expected = _answer(llm, SYSTEM + DOC_A + QUESTION)
            assert list(out.outputs[0].token_ids) == expected
        # A question of several blocks: its scoring requests cache none.
        long_question = list(range(600, 680))
        out = generate(llm, [SYSTEM, DOC_A, DOC_B, long_question], attention="paths")
        assert voting.num_decided == 2 and out.outputs[0].token_ids


def test_more_documents_than_the_cap_run_jointly_and_say_so(model_dir: str) -> None:
    """``--chunk-paths-max-documents 2``: three documents in ``paths`` or
    ``choose`` spawn no scoring request and answer as the joint prompt (as
    plain vLLM: every chunk is new), the response and the counter saying
    so; two documents still take paths."""
    with chunk_cache_llm(
        model_dir, chunk_attention="paths", chunk_paths_max_documents=2
    ) as llm:
        feature = scheduler_of(llm).feature("chunk_cache")
        side, voting = feature.side, feature.voting
        out = generate(llm, [SYSTEM, *DOCS, QUESTION])
        assert out.kv_transfer_params[PATHS_CAPPED] == 2
        assert voting.num_decided == 0 and not voting.ballots.by_request
        chose = generate(llm, [SYSTEM, *DOCS, QUESTION], attention="choose")
        assert chose.kv_transfer_params[PATHS_CAPPED] == 2
        assert (side.store.stats.paths_capped, side.store.stats.decided) == (2, 0)
        expected = _answer(llm, chunked_prompt([SYSTEM, *DOCS, QUESTION])[0])
        assert list(out.outputs[0].token_ids) == expected
        assert list(chose.outputs[0].token_ids) == expected
        two = generate(llm, [SYSTEM, DOC_A, DOC_B, QUESTION])
        assert two.kv_transfer_params[DOCUMENTS_KEPT] == 1
        assert voting.num_decided == 1 and side.store.stats.paths_capped == 2


def test_choose_answers_on_the_close_documents_jointly(model_dir: str) -> None:
    """``choose`` with a margin that keeps every document and k = 2: the
    request is answered on the two likeliest documents, in the client's
    order, as an ordinary request on that prompt answers (its first kept
    document found cached); the response says how many were kept; k = 1 is
    ``paths``."""
    with chunk_cache_llm(
        model_dir, chunk_attention="choose", chunk_choose_margin=100.0
    ) as llm:
        free = num_free_blocks(llm)
        side = scheduler_of(llm).feature("chunk_cache").side
        out = generate(llm, [SYSTEM, *DOCS, QUESTION])
        assert out.kv_transfer_params[DOCUMENTS_KEPT] == 2
        assert (side.store.stats.decided, side.store.stats.documents_kept) == (1, 2)
        llm.reset_prefix_cache()
        scores = [_question_logprob(llm, doc) for doc in DOCS]
        ranked = sorted(range(len(DOCS)), key=lambda i: (-scores[i], i))
        assert scores[ranked[1]] - scores[ranked[2]] > 0.1  # not a near tie
        kept = sorted(ranked[:2])
        expected = _answer(llm, SYSTEM + DOCS[kept[0]] + DOCS[kept[1]] + QUESTION)
        assert list(out.outputs[0].token_ids) == expected
        one = generate(llm, [SYSTEM, *DOCS, QUESTION], attention="paths")
        assert one.kv_transfer_params[DOCUMENTS_KEPT] == 1
        assert list(one.outputs[0].token_ids) == _answer(
            llm, SYSTEM + DOCS[ranked[0]] + QUESTION
        )
        assert num_free_blocks(llm) == free


def test_the_threshold_judges_a_paths_request_on_its_prompt(model_dir: str) -> None:
    """Beside the cache-hit threshold: a ``choose`` request is judged on
    arrival on the prompt it was sent with (vLLM's prefix cache; the chunk
    store holds nothing for it). Rejected, its scoring requests are aborted
    and every block comes back; admitted, it is decided as alone."""
    with chunk_cache_llm(
        model_dir, chunk_attention="choose", global_cache_hit_threshold=0.0
    ) as llm:
        free = num_free_blocks(llm)
        voting = scheduler_of(llm).feature("chunk_cache").voting
        token_ids, lengths = chunked_prompt([SYSTEM, *DOCS, QUESTION])

        def run(threshold: float):
            extra_args = {**seal({CHUNKS: lengths}), "cache_hit_threshold": threshold}
            params = SamplingParams(
                max_tokens=4, temperature=0.0, extra_args=extra_args
            )
            (out,) = llm.generate([{"prompt_token_ids": token_ids}], params)
            return out

        rejected = run(0.9)
        assert rejected.outputs[0].finish_reason == "cache_threshold"
        assert not rejected.outputs[0].token_ids and voting.num_decided == 0
        assert not voting.ballots.by_request and num_free_blocks(llm) == free
        admitted = run(0.0)
        assert admitted.outputs[0].finish_reason == "length"
        assert voting.num_decided == 1 and num_free_blocks(llm) == free


def test_a_continuation_of_a_paths_request_runs_jointly(
    model_dir: str, hf_model
) -> None:
    """A child of a parent answered on a path continues the prompt its
    client sent (the parent's chunks, its output, the suffix), jointly: its
    documents were stored by the parent's paths, each after the system
    prompt, so it answers as the chunk cache's reference on those tokens
    (the first document in place, the second moved), inheriting the
    parent's blocks only where they agree."""
    with chunk_cache_llm(
        model_dir, chunk_attention="paths", enable_continuation=True
    ) as llm:
        free = num_free_blocks(llm)
        voting = scheduler_of(llm).feature("chunk_cache").voting
        token_ids, lengths = chunked_prompt([SYSTEM, DOC_A, DOC_B, QUESTION])
        params = SamplingParams(
            max_tokens=5, temperature=0.0, ignore_eos=True,
            extra_args={**seal({CHUNKS: lengths}), "retain_kv": True},
        )  # fmt: skip
        (parent,) = llm.generate([{"prompt_token_ids": token_ids}], params)
        assert voting.num_decided == 1
        suffix = [11, 12, 13]
        child = llm.generate_continuation(
            parent.request_id,
            suffix,
            SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        )
        assert voting.num_decided == 1  # the child ran jointly
        question = QUESTION + list(parent.outputs[0].token_ids) + suffix
        paths = [[SYSTEM, DOC_A, QUESTION], [SYSTEM, DOC_B, QUESTION]]
        segments = [SYSTEM, DOC_A, DOC_B, question]
        expected, _ = stored_reference(hf_model, paths, segments, 4)
        llm.reset_prefix_cache()  # releases the retained parent
        assert list(child.outputs[0].token_ids) == expected
        assert child.num_cached_tokens >= len(SYSTEM) // 32 * 32
        llm.reset_prefix_cache()
        assert num_free_blocks(llm) == free


def test_paths_load_their_prefixes_from_the_chunk_store(model_dir: str) -> None:
    """Over a corpus vLLM's prefix cache lets a path's ``system + document``
    go; the chunk store keeps each document as its scoring request computed
    it after the system prompt, and later scoring requests (and the decided
    request's first kept document) load it exactly: the same scores, the
    same decision, the same answer as computing everything."""
    with chunk_cache_llm(
        model_dir, chunk_attention="choose", chunk_choose_margin=100.0
    ) as llm:
        free = num_free_blocks(llm)
        stats = scheduler_of(llm).feature("chunk_cache").side.store.stats
        first = generate(llm, [SYSTEM, *DOCS, QUESTION])
        assert stats.saved >= len(DOCS)  # each document, after the system prompt
        llm.reset_prefix_cache()  # vLLM's prefix cache forgets; the store keeps
        exact = stats.exact_hits
        again = generate(llm, [SYSTEM, *DOCS, QUESTION])
        # Each scoring request loads system + its document; the decided
        # request its system prompt and first kept document.
        assert stats.exact_hits - exact == 2 * len(DOCS) + 2
        assert again.kv_transfer_params[DOCUMENTS_KEPT] == 2
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        llm.reset_prefix_cache()
        scores = [_question_logprob(llm, doc) for doc in DOCS]
        kept = sorted(sorted(range(len(DOCS)), key=lambda i: (-scores[i], i))[:2])
        expected = _answer(llm, SYSTEM + DOCS[kept[0]] + DOCS[kept[1]] + QUESTION)
        assert list(again.outputs[0].token_ids) == expected
        assert num_free_blocks(llm) == free
