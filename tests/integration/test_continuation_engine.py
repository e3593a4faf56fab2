"""Continuation requests through a real vLLM engine (offline LLM API)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vllm import LLM, SamplingParams
from vllm.exceptions import VLLMValidationError

from tests.integration.conftest import make_llm, num_free_blocks, scheduler_of
from vllm_kvreuse.continuation.registry import ParentNotFound, registry_of
from vllm_kvreuse.core.request_keys import PARENT, seal

PROMPT = list(range(500, 600))  # 100 tokens
SUFFIX = [7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def llm(model_dir: str) -> Iterator[LLM]:
    engine = make_llm(model_dir, enable_continuation=True)
    yield engine
    del engine


@pytest.fixture(autouse=True)
def released(llm: LLM) -> Iterator[None]:
    """Every block is back once retained parents are released."""
    before = num_free_blocks(llm)
    yield
    llm.reset_prefix_cache()
    assert num_free_blocks(llm) == before, "KV blocks leaked by this test"


def greedy(max_tokens: int, **extra_args) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
        extra_args=extra_args or None,
    )  # fmt: skip


def run_parent(llm: LLM, prompt=PROMPT, **extra):
    (parent,) = llm.generate([{"prompt_token_ids": prompt}], greedy(20, **extra))
    return parent


def reference(llm: LLM, prompt: list[int], max_tokens: int = 8):
    """The same tokens as an ordinary request, computed from scratch."""
    llm.reset_prefix_cache()
    (out,) = llm.generate([{"prompt_token_ids": prompt}], greedy(max_tokens))
    return out


def test_child_computes_suffix_plus_one_and_matches_full_recompute(llm: LLM) -> None:
    parent = run_parent(llm, retain_kv=True)
    child = llm.generate_continuation(parent.request_id, SUFFIX, greedy(8))
    expected = PROMPT + list(parent.outputs[0].token_ids) + SUFFIX
    assert child.prompt_token_ids == expected
    assert child.num_cached_tokens == len(expected) - len(SUFFIX) - 1
    assert child.outputs[0].token_ids == reference(llm, expected).outputs[0].token_ids


def test_children_with_different_suffixes_each_match(llm: LLM) -> None:
    """Copy-on-write: children writing different tokens into the parent's
    partial last block must not see each other's KV."""
    parent = run_parent(llm, retain_kv=True)
    base = PROMPT + list(parent.outputs[0].token_ids)
    suffixes = [[21, 22], [31, 32, 33], [41]]
    prompts = [{"prompt_token_ids": base + s} for s in suffixes]
    params = greedy(8, **seal({PARENT: _engine_id(llm, parent)}))
    children = llm.generate(prompts, params)  # one batch
    for suffix, out in zip(suffixes, children, strict=True):
        assert out.num_cached_tokens == len(base) - 1
        expected = reference(llm, base + suffix).outputs[0].token_ids
        assert out.outputs[0].token_ids == expected, f"suffix {suffix} diverged"


def _engine_id(llm: LLM, parent) -> str:
    """The parent's engine request id, as the frontend registry knows it."""
    record = registry_of(llm.llm_engine.output_processor).find(
        parent.request_id, 0, None, 60.0
    )
    return record.engine_request_id


def test_parent_without_retention_is_continued_best_effort(llm: LLM) -> None:
    parent = run_parent(llm)
    child = llm.generate_continuation(parent.request_id, SUFFIX, greedy(4))
    # Only the parent's full blocks were cached; its partial tail is recomputed.
    assert child.num_cached_tokens == 96
    assert child.prompt_token_ids == PROMPT + list(parent.outputs[0].token_ids) + SUFFIX


def test_choice_of_a_parallel_sampling_parent(llm: LLM) -> None:
    params = SamplingParams(
        n=2, max_tokens=6, temperature=1.0, ignore_eos=True,
        extra_args={"retain_kv": True},
    )  # fmt: skip
    (parent,) = llm.generate([{"prompt_token_ids": PROMPT}], params)
    second = parent.outputs[1]
    child = llm.generate_continuation(parent.request_id, SUFFIX, greedy(2), choice=1)
    assert child.prompt_token_ids == PROMPT + list(second.token_ids) + SUFFIX
    assert child.num_cached_tokens == len(child.prompt_token_ids) - len(SUFFIX) - 1


def test_unknown_parent_and_salt_mismatch_raise(llm: LLM) -> None:
    with pytest.raises(ParentNotFound):
        llm.generate_continuation("no-such-request", SUFFIX, greedy(2))
    (parent,) = llm.generate(
        [{"prompt_token_ids": PROMPT, "cache_salt": "tenant-a"}],
        greedy(4, retain_kv=True),
    )
    with pytest.raises(ParentNotFound):
        llm.generate_continuation(parent.request_id, SUFFIX, greedy(2))
    child = llm.generate_continuation(
        parent.request_id, SUFFIX, greedy(2), cache_salt="tenant-a"
    )
    assert child.num_cached_tokens == len(child.prompt_token_ids) - len(SUFFIX) - 1


def test_bad_retention_options_raise(llm: LLM) -> None:
    with pytest.raises(VLLMValidationError, match="retain_kv must be true or false"):
        run_parent(llm, retain_kv="yes")
    with pytest.raises(VLLMValidationError, match="retain_kv_ttl"):
        run_parent(llm, retain_kv=True, retain_kv_ttl=-1)


def test_ttl_given_as_a_string_is_honoured(llm: LLM) -> None:
    """``retain_kv_ttl: "30"`` passes validation (a number of seconds), so
    the frontend record must read it as one too."""
    parent = run_parent(llm, retain_kv=True, retain_kv_ttl="30")
    child = llm.generate_continuation(parent.request_id, SUFFIX, greedy(2))
    assert child.num_cached_tokens == len(child.prompt_token_ids) - len(SUFFIX) - 1


def test_parent_released_under_pressure_is_still_known(model_dir: str) -> None:
    """Pressure takes a retained parent's blocks, not its record: within its
    TTL the child is still answered, recomputing what the prefix cache lost,
    and its output is that of the same tokens sent as an ordinary request."""
    engine = make_llm(
        model_dir, enable_continuation=True, num_gpu_blocks_override=16,
        max_model_len=448,
        retain_kv_max_fraction=1.0,
    )  # fmt: skip
    try:
        parent = run_parent(engine, retain_kv=True, retain_kv_ttl=60)
        ledger = scheduler_of(engine).kvreuse.ledger
        assert len(ledger) == 1
        # 12 blocks do not fit next to the parent's 4 in a 15-block pool.
        engine.generate([{"prompt_token_ids": list(range(2000, 2384))}], greedy(1))
        assert len(ledger) == 0, "pressure released the parent"
        child = engine.generate_continuation(parent.request_id, SUFFIX, greedy(8))
        expected = PROMPT + list(parent.outputs[0].token_ids) + SUFFIX
        assert child.prompt_token_ids == expected
        assert child.num_cached_tokens < len(expected) - len(SUFFIX) - 1
        want = reference(engine, expected).outputs[0].token_ids
        assert child.outputs[0].token_ids == want
    finally:
        del engine
