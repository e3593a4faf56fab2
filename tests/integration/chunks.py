"""Shared pieces of the chunk-cache integration tests: prompts, an engine
factory, and the Hugging Face chunk-isolated reference."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from vllm import LLM, RequestOutput, SamplingParams

from tests.integration.conftest import make_llm, scheduler_of
from vllm_kvreuse.chunk_cache.frontend import chunked_prompt
from vllm_kvreuse.chunk_cache.store import ChunkIndex
from vllm_kvreuse.core.accounting import check_block_accounting
from vllm_kvreuse.core.request_keys import CHUNKS, seal
from vllm_kvreuse.testing.reference import chunk_attention_mask

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
    # These tests check chunk isolation itself: no recompute unless asked
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
    return scheduler_of(llm).connector.scheduler_side.index


def generate(
    llm: LLM, segments: list[list[int]], max_tokens: int = 6, recompute: Any = None
) -> RequestOutput:
    token_ids, lengths = chunked_prompt(segments)
    extra_args = seal({CHUNKS: lengths})
    if recompute is not None:
        extra_args["chunk_recompute"] = recompute
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
