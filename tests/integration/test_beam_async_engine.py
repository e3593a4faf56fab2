"""Engine beam search with async scheduling, in a real engine on this CPU.

vLLM's CPU platform turns async scheduling off ("not required on CPU");
both runners run with it anyway (the engine core's batch queue of two,
``AsyncScheduler``, the runners' async outputs), so this module turns it
back on in its engines (a test-only override of the platform's config
hook) and checks what CUDA users get by default: every beam group advances
one token per engine step, and the beams equal vLLM's own loop, also when
two groups share a pool too small for both (preemptions with outputs in
flight).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vllm import LLM
from vllm.platforms.cpu import CpuPlatform
from vllm.sampling_params import BeamSearchParams

from tests.integration.conftest import make_llm, scheduler_of
from tests.integration.test_beam_search_engine import prompts

pytestmark = pytest.mark.usefixtures("no_leak")


def _keep_async_scheduling(original):
    def check_and_update_config(cls, vllm_config) -> None:
        original(vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    return classmethod(check_and_update_config)


@pytest.fixture(scope="module")
def llm(model_dir: str) -> Iterator[LLM]:
    """A 20-block pool, async scheduling on."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            CpuPlatform,
            "check_and_update_config",
            _keep_async_scheduling(CpuPlatform.check_and_update_config),
        )
        engine = make_llm(
            model_dir, max_model_len=256, num_gpu_blocks_override=20,
            max_logprobs=32, engine_beam_search=True,
        )  # fmt: skip
    core = engine.llm_engine.engine_core.engine_core
    assert core.async_scheduling and core.batch_queue_size == 2
    yield engine
    del engine


def summary(outputs) -> list[list[list[int]]]:
    return [[seq.tokens for seq in out.sequences] for out in outputs]


def test_a_lone_group_generates_one_token_per_engine_step(llm: LLM) -> None:
    """12 tokens: the root's prefill gives the first, its members the next
    11 in 11 consecutive engine steps (before: every other step)."""
    scheduler = scheduler_of(llm)
    members_per_step: list[int] = []
    schedule = scheduler.schedule

    def counted(*args, **kwargs):
        output = schedule(*args, **kwargs)
        members_per_step.append(sum("-beam" in r for r in output.num_scheduled_tokens))
        return output

    scheduler.schedule = counted
    try:
        params = BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True)
        (out,) = llm.beam_search(prompts(1, first_seed=2), params)
    finally:
        del scheduler.schedule
    steps = [i for i, n in enumerate(members_per_step) if n]
    assert [members_per_step[i] for i in steps] == [4] * 11
    assert steps == list(range(steps[0], steps[0] + 11)), members_per_step
    assert all(len(seq.tokens) == 30 + 18 + 12 for seq in out.sequences)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_same_beams_as_vllm_loop_under_pressure(llm: LLM, ignore_eos: bool) -> None:
    """Two groups of six beams over 40 tokens share 20 blocks: members are
    preempted with outputs in flight, recompute, and the beams still equal
    vLLM's own loop run on the same engine."""
    params = BeamSearchParams(beam_width=6, max_tokens=40, ignore_eos=ignore_eos)
    batch = prompts(2, first_seed=3)
    expected = summary(type(llm).beam_search.__wrapped__(llm, batch, params))
    got = summary(llm.beam_search(batch, params, concurrency_limit=2))
    assert got == expected
    assert scheduler_of(llm).feature("beam").groups.is_empty()
