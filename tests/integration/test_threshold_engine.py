"""The cache-hit threshold through a real vLLM engine (offline LLM API)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY
from vllm import LLM, SamplingParams
from vllm.exceptions import VLLMValidationError

from tests.integration.conftest import make_llm, num_free_blocks, scheduler_of

pytestmark = pytest.mark.usefixtures("no_leak")

REJECTIONS = "vllm_kvreuse:cache_threshold_rejections_total"


@pytest.fixture(scope="module")
def llm(model_dir: str) -> Iterator[LLM]:
    engine = make_llm(model_dir, global_cache_hit_threshold=0.5)
    yield engine
    del engine


def prompt_ids(seed: int, length: int = 96) -> dict:
    """A token prompt no other test uses (distinct first token)."""
    return {
        "prompt_token_ids": [seed]
        + [(seed * 7 + i) % 3000 + 50 for i in range(length - 1)]
    }


def greedy(max_tokens: int = 4, **extra_args) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, extra_args=extra_args or None
    )


def rejections(stage: str) -> float:
    return REGISTRY.get_sample_value(REJECTIONS, {"stage": stage}) or 0.0


def test_global_flag_reaches_the_engine_scheduler(llm: LLM) -> None:
    assert scheduler_of(llm).feature("admission").global_threshold == 0.5


def test_cold_request_rejected_then_accepted_once_cached(llm: LLM) -> None:
    prompt = prompt_ids(1)
    before = rejections("admission")
    (cold,) = llm.generate([prompt], greedy())
    assert cold.outputs[0].finish_reason == "cache_threshold"
    assert cold.outputs[0].token_ids == []
    assert rejections("admission") == before + 1

    (seed,) = llm.generate([prompt], greedy(cache_hit_threshold=0.0))
    assert seed.outputs[0].finish_reason == "length"

    (warm,) = llm.generate([prompt], greedy())
    assert warm.outputs[0].finish_reason == "length"
    assert warm.num_cached_tokens == 64  # 2 of 3 blocks: the last token is computed
    assert warm.outputs[0].token_ids == seed.outputs[0].token_ids


def test_request_value_overrides_the_global_one(llm: LLM) -> None:
    prompt = prompt_ids(2)
    (lenient,) = llm.generate([prompt], greedy(cache_hit_threshold=0.0))
    assert lenient.outputs[0].finish_reason == "length"
    (strict,) = llm.generate([prompt], greedy(cache_hit_threshold=0.9))
    assert strict.outputs[0].finish_reason == "cache_threshold"


def test_every_parallel_sample_is_rejected(llm: LLM) -> None:
    params = SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=None)
    (out,) = llm.generate([prompt_ids(3)], params)
    assert [c.finish_reason for c in out.outputs] == ["cache_threshold"] * 3


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan"), "high", True])
def test_bad_threshold_raises_before_reaching_the_engine(llm: LLM, bad) -> None:
    with pytest.raises(VLLMValidationError, match="cache_hit_threshold must be"):
        llm.generate([prompt_ids(4)], greedy(cache_hit_threshold=bad))
    (ok,) = llm.generate([prompt_ids(4)], greedy(cache_hit_threshold=0.0))
    assert ok.outputs[0].finish_reason == "length", "engine stopped serving"


@pytest.fixture(scope="module")
def small_pool_llm(model_dir: str, llm: LLM) -> Iterator[LLM]:
    """16 blocks of 32 tokens: four 215-token requests must preempt."""
    engine = make_llm(
        model_dir,
        max_model_len=256,
        num_gpu_blocks_override=16,
        global_cache_hit_threshold=0.0,
    )
    yield engine
    del engine


def test_preempted_request_is_rejected_with_its_output(small_pool_llm: LLM) -> None:
    """RFC #24256 use case 1: a preempted request that would recompute too much
    comes back with cache_threshold and the tokens it had produced."""
    llm = small_pool_llm
    prompt = prompt_ids(5, length=65)
    llm.generate([prompt], greedy(max_tokens=1))  # caches the 2 full prompt blocks
    before = rejections("preempted")
    params = SamplingParams(
        max_tokens=150, ignore_eos=True, extra_args={"cache_hit_threshold": 0.9}
    )
    outputs = llm.generate([prompt] * 4, params)

    reasons = [o.outputs[0].finish_reason for o in outputs]
    assert "cache_threshold" in reasons, f"no preempted request was rejected: {reasons}"
    assert "length" in reasons
    for out in outputs:
        completion = out.outputs[0]
        if completion.finish_reason == "cache_threshold":
            assert 0 < len(completion.token_ids) < 150, "partial output not returned"
            assert out.prompt_token_ids == prompt["prompt_token_ids"]
        else:
            assert len(completion.token_ids) == 150
    assert rejections("preempted") == before + reasons.count("cache_threshold")
    assert num_free_blocks(llm) == 15  # all 16 but the null block
