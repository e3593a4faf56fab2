"""Every feature with ``tensor_parallel_size=2``: the same tokens as one worker.

Each worker holds half the KV heads (the tiny model has 2). Copy-on-write
tails (continuation, beam forks) are copied by each worker in its own shard;
the chunk cache stores, loads and re-rotates each worker's heads. Greedy
outputs, cached-token counts and beams must equal those of one worker.
The whole engine suite runs under TP with ``KVREUSE_TENSOR_PARALLEL=2``
(docs/deployment.md).
"""

from __future__ import annotations

import os

import pytest
import torch
from vllm import LLM, SamplingParams
from vllm.sampling_params import BeamSearchParams

from tests.integration.chunks import chunk_cache_llm

FEATURES = dict(
    enable_continuation=True,
    engine_beam_search=True,
    global_cache_hit_threshold=0.0,
)
PROMPT = [(7 * i) % 3000 + 60 for i in range(90)]
RAG = "##".join(["You answer. " * 8, "Doc one is long. " * 12, "Which?"])


def run_features(llm: LLM) -> dict:
    greedy = SamplingParams(max_tokens=5, temperature=0.0)
    parent = llm.generate(
        [{"prompt_token_ids": PROMPT}],
        SamplingParams(max_tokens=5, temperature=0.0, extra_args={"retain_kv": True}),
        use_tqdm=False,
    )[0]
    child = llm.generate_continuation(parent.request_id, [3, 4, 5], greedy)
    cold, warm = (llm.generate([RAG], greedy, use_tqdm=False)[0] for _ in range(2))
    (beams,) = llm.beam_search(
        [{"prompt_token_ids": PROMPT}], BeamSearchParams(beam_width=4, max_tokens=3)
    )
    rejected = llm.generate(
        [{"prompt_token_ids": PROMPT[::-1]}],
        SamplingParams(max_tokens=2, extra_args={"cache_hit_threshold": 0.9}),
        use_tqdm=False,
    )[0]
    return {
        "parent": list(parent.outputs[0].token_ids),
        "child": list(child.outputs[0].token_ids),
        "child_cached": child.num_cached_tokens,
        "rag": [list(cold.outputs[0].token_ids), list(warm.outputs[0].token_ids)],
        "rag_warm_cached": warm.num_cached_tokens,
        "beams": [seq.tokens for seq in beams.sequences],
        "rejected": rejected.outputs[0].finish_reason,
    }


CPUS = sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(
    torch.cuda.device_count() == 1 or len(CPUS) < 2,
    reason="two workers need two GPUs, or two cores on CPU",
)
def test_two_workers_give_what_one_gives(model_dir: str, monkeypatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    with chunk_cache_llm(model_dir, **FEATURES, tensor_parallel_size=1) as one:
        expected = run_features(one)
    # Half the cores per worker (vLLM's CPU auto-binding wants a NUMA node each).
    halves = (CPUS[: len(CPUS) // 2], CPUS[len(CPUS) // 2 :])
    bind = "|".join(",".join(map(str, half)) for half in halves)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    with chunk_cache_llm(model_dir, **FEATURES, tensor_parallel_size=2) as two:
        assert run_features(two) == expected
    assert expected["child_cached"] == len(PROMPT) + 5 - 1  # all but the last
    assert expected["rag_warm_cached"] > 0
    assert expected["rejected"] == "cache_threshold"
