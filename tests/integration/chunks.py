"""Shared pieces of the chunk-cache integration tests: prompts, an engine
factory, and the Hugging Face references (full attention, and a chunked
prompt's loads and computed spans)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from vllm import LLM, RequestOutput, SamplingParams

from tests.integration.conftest import make_llm, scheduler_of
from vllm_kvreuse.chunk_cache.engine.index import ChunkIndex
from vllm_kvreuse.chunk_cache.engine.recompute import (
    Recompute,
    choose_spans,
    clip,
    merge,
)
from vllm_kvreuse.chunk_cache.frontend.segments import chunked_prompt
from vllm_kvreuse.core.accounting import check_block_accounting
from vllm_kvreuse.core.request_keys import CHUNKS, seal
from vllm_kvreuse.testing.reference import chunk_attention_mask, segmented_reference

SYSTEM = list(range(100, 140))
DOC_A = list(range(200, 290))
DOC_B = list(range(300, 333))
DOC_C = list(range(500, 570))
QUESTION = list(range(400, 410))


@contextlib.contextmanager
def chunk_cache_llm(model_dir: str, **kwargs) -> Iterator[LLM]:
    """An engine with the chunk cache, shut down on exit.

    vLLM keeps one worker-side KV connector per process, so only one
    chunk-cache engine may live in a process at a time; shutting it down
    releases the connector for the next.
    """
    # These tests check loads and computed chunks: no recompute unless asked
    # (test_chunk_cache_segments.py checks recomputed spans and the defaults).
    for name in ("chunk_recompute_head", "chunk_recompute_select"):
        kwargs.setdefault(name, 0)
    kwargs.setdefault("chunk_recompute_fraction", 0.0)
    engine = make_llm(model_dir, enable_chunk_cache=True, **kwargs)
    try:
        yield engine
        check_block_accounting(scheduler_of(engine))
    finally:
        engine.llm_engine.engine_core.shutdown()


def index_of(llm: LLM) -> ChunkIndex:
    return scheduler_of(llm).connector.scheduler_side.store.index


def generate(
    llm: LLM,
    segments: list[list[int]],
    max_tokens: int = 6,
    recompute: Any = None,
    attention: str | None = None,
) -> RequestOutput:
    token_ids, lengths = chunked_prompt(segments)
    extra_args = seal({CHUNKS: lengths})
    if recompute is not None:
        extra_args["chunk_recompute"] = recompute
    if attention is not None:
        extra_args["chunk_attention"] = attention
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=5,
        extra_args=extra_args,
    )  # fmt: skip
    (out,) = llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)
    return out


@torch.no_grad()
def hf_reference(
    model: Any,
    segments: list[list[int]],
    steps: int,
    see_system: bool = False,
    full_from: int | None = None,
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and first-step log-probs, chunk-isolated, actual
    positions; tokens from ``full_from`` on attend to everything before."""
    token_ids, lengths = chunked_prompt(segments)
    generated: list[int] = []
    first_logprobs = None
    for _ in range(steps):
        ids = torch.tensor([token_ids + generated])
        total = ids.shape[1]
        logits = model(
            input_ids=ids,
            attention_mask=chunk_attention_mask(lengths, total, see_system, full_from),
            position_ids=torch.arange(total)[None],
        ).logits[0, -1]
        if first_logprobs is None:
            first_logprobs = torch.log_softmax(logits, dim=-1)
        generated.append(int(logits.argmax()))
    return generated, first_logprobs


def full_attention(model: Any, segments: list[list[int]], steps: int):
    """Greedy tokens and first-step log-probs of the segments as one prompt."""
    return hf_reference(model, segments, steps, full_from=0)


def sources_after(
    seen: list[list[list[int]]], segments: list[list[int]]
) -> list[list[int] | None]:
    """What each chunk of ``segments`` was stored after, given the earlier
    prompts ``seen``: the tokens before the chunk's first appearance; None
    for a chunk seen nowhere (computed in place). Every prompt in ``seen``
    must have been computed exactly (each of its chunks new, or stored
    after the same tokens), as full attention computes it."""
    first: dict[tuple[int, ...], list[int]] = {}
    for prompt in seen:
        before: list[int] = []
        for chunk in prompt[:-1]:
            first.setdefault(tuple(chunk), list(before))
            before += chunk
    return [first.get(tuple(chunk)) for chunk in segments[:-1]]


def expected_spans(
    segments: list[list[int]],
    sources: list[list[int] | None],
    settings: Recompute,
) -> list[tuple[int, int]]:
    """The positions a chunked request computes: its new chunks, and the
    recomputed tokens of chunks stored after other tokens than here."""
    token_ids, lengths = chunked_prompt(segments)
    rules = choose_spans(token_ids, lengths, settings)
    spans, moved, start = [], [], 0
    for length, source in zip(lengths, sources, strict=True):
        if source is None:
            spans.append((start, start + length))
        elif source != token_ids[:start]:
            moved.append((start, start + length))
        start += length
    return merge(spans + clip(rules, moved))


def stored_reference(
    model: Any,
    seen: list[list[list[int]]],
    segments: list[list[int]],
    steps: int,
    settings: Recompute = Recompute(),  # noqa: B008
):
    """Greedy tokens and first-step log-probs of ``segments`` sent after the
    prompts ``seen``, as the chunk cache computes them: stored chunks loaded
    as computed where first seen (recomputed tokens computed here), new
    chunks computed in place."""
    token_ids, lengths = chunked_prompt(segments)
    sources = sources_after(seen, segments)
    spans = expected_spans(segments, sources, settings)
    return segmented_reference(model, token_ids, lengths, spans, steps, sources)
