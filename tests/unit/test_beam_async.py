"""A live group advances every engine step, with async scheduling too.

vLLM's CPU platform turns async scheduling off, so this drives vLLM's real
``AsyncScheduler`` (with the hook layer in front, every feature on) the way
the engine core's batch queue does (schedule the next batch while one
runs, then take the oldest output), with the stand-in worker
(:mod:`vllm_kvreuse.testing.fake_worker`) running each group's step through
the real worker code. The scheduler's V2 flag (what a V2 runner's engine
sets) changes how re-sent requests travel; the step count must not change.
"""

from __future__ import annotations

import pytest
from vllm.config import ModelConfig

from tests.unit.conftest import make_request
from tests.unit.scheduler_driver import Driver, make_full_scheduler
from vllm_kvreuse.beam import result as beam_result
from vllm_kvreuse.beam.rule import BeamConfig

PROMPT = list(range(300, 340))


def lone_search(
    model_config: ModelConfig, async_scheduling: bool, v2: bool, width: int, tokens: int
) -> tuple[int, list[int]]:
    """Engine steps from a lone search's arrival to its answer, and the
    steps that ran its members (in order)."""
    scheduler = make_full_scheduler(
        model_config, num_blocks=64, max_num_seqs=16,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    scheduler.use_v2_model_runner = v2  # what a V2 runner's engine sets
    driver = Driver(scheduler)
    config = BeamConfig(width=width, max_tokens=tokens, eos_token_id=2, ignore_eos=True)
    root = make_request("root", PROMPT, max_tokens=1, kvreuse_beam=config.to_dict())
    driver.add(root, "beam")
    member_steps = []
    while driver.has_work():
        before = driver.num_steps
        driver.step()
        members = [rid for rid in driver.scheduled if "-beam" in rid]
        if driver.num_steps > before and members:
            assert len(members) == width, f"a partial step: {members}"
            member_steps.append(driver.num_steps)
        if driver.clients["root"].finals:
            break
    (final,) = driver.clients["root"].finals
    result = beam_result.decode(final.stop_reason)
    assert result is not None and len(result.beams) == width
    assert all(len(beam.token_ids) == tokens for beam in result.beams)
    return driver.num_steps, member_steps


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_lone_group_generates_one_token_per_engine_step(
    model_config: ModelConfig, async_scheduling: bool, v2: bool
) -> None:
    """Members run every engine step: the workers apply each step's choice
    themselves, so the next step needs nothing the scheduler has not seen.
    (Before: with async scheduling, every other step.)"""
    width, tokens = 4, 12
    total, member_steps = lone_search(model_config, async_scheduling, v2, width, tokens)
    # Tokens 2 .. 12 come from the members, one per engine step, back to back.
    assert len(member_steps) == tokens - 1
    assert member_steps == list(range(member_steps[0], member_steps[0] + tokens - 1))
    # The root's prefill gives token 1; with async scheduling its result is in
    # one step later, so the members start one step later.
    assert member_steps[0] == (3 if async_scheduling else 2)
    assert total <= tokens + (2 if async_scheduling else 0)
