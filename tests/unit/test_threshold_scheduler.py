"""The cache-hit threshold inside a real vLLM Scheduler (no engine, no model)."""

from __future__ import annotations

import pytest
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from tests.conftest import BLOCK_SIZE
from tests.unit.conftest import (
    make_request,
    model_output,
    num_free_blocks,
    preempt,
    run_to_completion,
    step,
)
from vllm_kvreuse.admission.policy import FINISH_REASON

PROMPT_64 = list(range(100, 164))  # 2 blocks: at most 1 block (32 tokens) hits
PROMPT_97 = list(range(200, 297))  # 3 full blocks + 1 token: up to 96 hit


def warm(scheduler, prompt) -> None:
    """Runs ``prompt`` once so its full blocks are in the prefix cache."""
    scheduler.add_request(make_request("warm", prompt, max_tokens=1))
    run_to_completion(scheduler)


def assert_rejected(scheduler, outputs, request) -> None:
    rejections = [o for o in outputs if o.request_id == request.request_id]
    assert len(rejections) == 1, f"expected one output for {request.request_id}"
    (out,) = rejections
    assert out.finish_reason == FinishReason.ABORT
    assert out.stop_reason == FINISH_REASON
    assert out.new_token_ids == []
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert request.request_id not in scheduler.requests, "rejected request leaked"


def test_default_threshold_admits_cold_request(make_scheduler) -> None:
    scheduler = make_scheduler()
    request = make_request("a", PROMPT_64)
    scheduler.add_request(request)
    output, engine_outputs = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 64}
    assert all(o.stop_reason != FINISH_REASON for o in engine_outputs)


def test_cold_request_rejected_before_any_allocation(make_scheduler) -> None:
    scheduler = make_scheduler(global_cache_hit_threshold=0.5)
    free_before = num_free_blocks(scheduler)
    request = make_request("cold", PROMPT_64)
    scheduler.add_request(request)
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {}, "a rejected request was scheduled"
    assert num_free_blocks(scheduler) == free_before, "rejection allocated blocks"
    assert scheduler.feature("admission").num_rejections == 1
    outputs = scheduler.update_from_output(output, model_output(output))
    assert_rejected(scheduler, outputs[0].outputs, request)
    assert not scheduler.has_requests()


@pytest.mark.parametrize(
    ("threshold", "admitted"),
    [(0.0, True), (0.25, True), (0.5, True), (0.5 + 1e-9, False), (1.0, False)],
)
def test_boundary_hit_rate_equal_to_threshold_is_admitted(
    make_scheduler, threshold: float, admitted: bool
) -> None:
    """64-token prompt with its first block cached: hit rate exactly 0.5."""
    scheduler = make_scheduler()
    warm(scheduler, PROMPT_64)
    request = make_request("b", PROMPT_64, cache_hit_threshold=threshold)
    scheduler.add_request(request)
    output, engine_outputs = step(scheduler)
    if admitted:
        assert output.num_scheduled_tokens == {"b": 64 - BLOCK_SIZE}
    else:
        assert output.num_scheduled_tokens == {}
        assert_rejected(scheduler, engine_outputs, request)


def test_request_threshold_overrides_global(make_scheduler) -> None:
    scheduler = make_scheduler(global_cache_hit_threshold=0.9)
    lenient = make_request("lenient", PROMPT_64, cache_hit_threshold=0.0)
    strict_default = make_request("strict", PROMPT_97)
    scheduler.add_request(lenient)
    scheduler.add_request(strict_default)
    output, engine_outputs = step(scheduler)
    assert output.num_scheduled_tokens == {"lenient": 64}
    assert_rejected(scheduler, engine_outputs, strict_default)

    scheduler = make_scheduler(global_cache_hit_threshold=0.0)
    strict = make_request("strict", PROMPT_64, cache_hit_threshold=0.1)
    scheduler.add_request(strict)
    _, engine_outputs = step(scheduler)
    assert_rejected(scheduler, engine_outputs, strict)


def test_admitted_request_is_not_judged_again(make_scheduler) -> None:
    """Once admitted, a request runs to the end even if its cache disappears."""
    scheduler = make_scheduler()
    warm(scheduler, PROMPT_97)
    request = make_request("r", PROMPT_97, max_tokens=3, cache_hit_threshold=0.9)
    scheduler.add_request(request)
    outputs = run_to_completion(scheduler)
    finals = [o for o in outputs if o.finish_reason is not None]
    assert [o.finish_reason for o in finals] == [FinishReason.LENGTH]
    assert scheduler.feature("admission").num_rejections == 0


@pytest.mark.parametrize(("threshold", "rejected"), [(0.9, True), (0.8, False)])
def test_preempted_request_is_judged_again(
    make_scheduler, threshold: float, rejected: bool
) -> None:
    """After preemption the request needs 97 + 10 tokens of KV; 96 are cached."""
    scheduler = make_scheduler()
    free_at_start = num_free_blocks(scheduler)
    warm(scheduler, PROMPT_97)
    request = make_request("p", PROMPT_97, max_tokens=50, cache_hit_threshold=threshold)
    scheduler.add_request(request)
    for _ in range(10):
        step(scheduler)
    assert request.num_output_tokens == 10
    preempt(scheduler, request)
    assert request.status == RequestStatus.PREEMPTED

    output, engine_outputs = step(scheduler)
    if rejected:
        assert output.num_scheduled_tokens == {}
        assert_rejected(scheduler, engine_outputs, request)
        # The frontend already holds the 10 tokens; the router can resubmit
        # prompt + output elsewhere (RFC #24256, phase 2).
        assert list(request.output_token_ids) == [7] * 10
    else:
        assert output.num_scheduled_tokens == {"p": 97 + 10 - 96}
        run_to_completion(scheduler)
    assert num_free_blocks(scheduler) == free_at_start


def test_no_block_leaks_after_mixed_traffic(make_scheduler) -> None:
    scheduler = make_scheduler(global_cache_hit_threshold=0.5)
    free_at_start = num_free_blocks(scheduler)
    for i in range(6):
        threshold = 0.0 if i % 2 else None
        extra = {} if threshold is None else {"cache_hit_threshold": threshold}
        scheduler.add_request(make_request(f"m{i}", PROMPT_97, max_tokens=5, **extra))
    outputs = run_to_completion(scheduler)
    reasons = sorted(str(o.stop_reason) for o in outputs if o.finish_reason is not None)
    assert reasons.count(FINISH_REASON) == 3
    assert num_free_blocks(scheduler) == free_at_start
