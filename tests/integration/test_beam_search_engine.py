"""Offline ``LLM.beam_search`` with engine-side beam search, against vLLM's own
front-end loop run on the same engine (the patched method's ``__wrapped__``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from vllm import LLM
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import BeamSearchParams

from tests.integration.conftest import make_llm, scheduler_of

pytestmark = pytest.mark.usefixtures("no_leak")


@pytest.fixture(scope="module")
def llm(model_dir: str) -> Iterator[LLM]:
    """A 20-block pool: four 4-beam groups at once must share it under pressure."""
    engine = make_llm(
        model_dir, max_model_len=256, num_gpu_blocks_override=20, max_logprobs=32,
        engine_beam_search=True,
    )  # fmt: skip
    yield engine
    del engine


def prompts(count: int, first_seed: int = 0) -> list[dict]:
    return [
        {
            "prompt_token_ids": [
                (s * 131 + i * 17) % 3500 + 50 for i in range(30 + 9 * s)
            ]
        }
        for s in range(first_seed, first_seed + count)
    ]


def summary(outputs) -> list[list[tuple[list[int], float]]]:
    return [[(seq.tokens, seq.cum_logprob) for seq in out.sequences] for out in outputs]


TIE = 1e-3 if not torch.cuda.is_available() else 5e-3
"""Scores closer than this may be ranked either way. Engine beams keep each
beam's KV as computed while decoding; vLLM's loop prefills every beam's
tokens again. On a CPU the two agree to 1e-6 and the beams are identical;
on a GPU (float32 falls back to TRITON_ATTN there) three-token scores round
apart by up to 1.5e-3 (H200, 2026-11-28; 5e-4 in an earlier run), which
swapped two beams 1.8e-4 apart."""


def assert_same_ranking(want: list, have: list) -> None:
    """The same beams in the same order, scores equal to ``TIE``; on a GPU,
    beams at one rank whose scores are within ``TIE`` may differ."""
    assert len(have) == len(want)
    if not torch.cuda.is_available():
        assert [t for t, _ in have] == [t for t, _ in want]
    for (tokens, score), (want_tokens, want_score) in zip(have, want, strict=True):
        assert score == pytest.approx(want_score, abs=TIE)
        if tokens != want_tokens:  # a tie: the loop has no better beam here
            assert tokens not in [t for t, _ in want], "a beam ranked elsewhere"


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_same_beams_as_vllm_offline_loop(
    llm: LLM, ignore_eos: bool, record_property
) -> None:
    # ignore_eos: each beam's request returns its top `width` log-probs, not
    # vLLM's 2 * width (BeamConfig.row_size); the beams must not change.
    params = BeamSearchParams(beam_width=4, max_tokens=3, ignore_eos=ignore_eos)
    batch = prompts(6)
    expected = summary(type(llm).beam_search.__wrapped__(llm, batch, params))
    got = summary(llm.beam_search(batch, params, concurrency_limit=4))
    assert len(got) == len(expected) == 6
    for number, (want, have) in enumerate(zip(expected, got, strict=True)):
        if have != want:  # the GPU report prints (new tokens, score) by rank
            tails = [[(t[-3:], round(s, 5)) for t, s in b] for b in (want, have)]
            record_property(f"prompt {number}: vLLM's loop, engine beams", tails)
        assert_same_ranking(want, have)
    assert scheduler_of(llm).feature("beam").groups.is_empty(), "groups outlived search"


def test_sequences_hold_prompt_text_and_finish_reason(llm: LLM) -> None:
    (batch,) = [prompts(1, first_seed=7)]
    (out,) = llm.beam_search(batch, BeamSearchParams(beam_width=2, max_tokens=2))
    prompt_ids = batch[0]["prompt_token_ids"]
    assert len(out.sequences) == 2
    for seq in out.sequences:
        assert seq.tokens[: len(prompt_ids)] == prompt_ids
        assert len(seq.tokens) == len(prompt_ids) + 2
        assert seq.text and seq.finish_reason == "length"


def test_width_too_large_for_the_pool_is_refused(llm: LLM) -> None:
    """200 tokens and 16 beams need at least 7 + 15 blocks; the pool has 19."""
    params = BeamSearchParams(beam_width=16, max_tokens=3)
    with pytest.raises(VLLMValidationError, match="needs at least 22 KV blocks"):
        llm.beam_search([{"prompt_token_ids": list(range(100, 300))}], params)
    (ok,) = llm.beam_search(prompts(1), BeamSearchParams(beam_width=2, max_tokens=1))
    assert len(ok.sequences) == 2


def test_beams_live_across_steps(llm: LLM, monkeypatch) -> None:
    """Each beam is one engine request for the whole search: a group spawns
    its ``width`` members once; a member that takes another beam gets its
    parent's private KV blocks copied by the worker, over block boundaries,
    two groups sharing a 20-block pool, and the beams still equal vLLM's
    own loop."""
    from vllm_kvreuse.beam.worker import runner_hooks

    copies: list[int] = []
    original = runner_hooks.copy_blocks_indexed

    def counted(kv_caches, num_blocks, src, dst) -> None:
        copies.append(int((src != dst).sum()))
        original(kv_caches, num_blocks, src, dst)

    monkeypatch.setattr(runner_hooks, "copy_blocks_indexed", counted)
    core = scheduler_of(llm).kvreuse
    params = BeamSearchParams(beam_width=6, max_tokens=40)  # 57 + 40 > 3 blocks
    batch = prompts(2, first_seed=3)
    expected = summary(type(llm).beam_search.__wrapped__(llm, batch, params))
    spawned = core.internal.num_spawned
    got = summary(llm.beam_search(batch, params, concurrency_limit=2))
    for want, have in zip(expected, got, strict=True):
        assert [tokens for tokens, _ in have] == [tokens for tokens, _ in want]
        for (_, a), (_, b) in zip(have, want, strict=True):
            assert a == pytest.approx(b, abs=1e-3)
    assert core.internal.num_spawned - spawned == 2 * 6  # not 2 * 6 * 39
    assert sum(copies) > 0  # members took other beams (their KV copied)


def test_the_last_step_copies_no_kv(llm: LLM, monkeypatch) -> None:
    """A group's last step selects final beams: no member computes their
    KV, so the workers copy none (on a GPU, a gather and a scatter a layer
    left out). Two tokens: the members' one step is the last. The beams are
    still vLLM's loop's."""
    from vllm_kvreuse.beam.worker import runner_hooks

    copies: list[int] = []
    original = runner_hooks.copy_blocks_indexed

    def counted(kv_caches, num_blocks, src, dst) -> None:
        copies.append(len(src))
        original(kv_caches, num_blocks, src, dst)

    monkeypatch.setattr(runner_hooks, "copy_blocks_indexed", counted)
    params = BeamSearchParams(beam_width=4, max_tokens=2, ignore_eos=True)
    batch = prompts(3, first_seed=5)
    expected = summary(type(llm).beam_search.__wrapped__(llm, batch, params))
    outputs = llm.beam_search(batch, params, concurrency_limit=3)
    for want, have in zip(expected, summary(outputs), strict=True):
        assert_same_ranking(want, have)
    assert copies == []


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_step_of_beams_alone_draws_nothing(
    llm: LLM, ignore_eos: bool, runner: str
) -> None:
    """A step whose rows are all beam members (greedy, no log-probs asked)
    skips upstream's sampler: every token is the beam step's. The beams are
    still vLLM's loop's. (V1 runner: the V2 runner's sampler still draws.)"""
    if runner != "v1":
        pytest.skip("the V2 runner's sampler draws for beam rows too")
    from vllm.v1.sample.sampler import Sampler

    params = BeamSearchParams(beam_width=4, max_tokens=5, ignore_eos=ignore_eos)
    batch = prompts(3, first_seed=11)
    expected = summary(type(llm).beam_search.__wrapped__(llm, batch, params))
    draws: list[int] = []
    original = Sampler.sample

    def counted(self, logits, *args, **kwargs):
        draws.append(len(logits))
        return original(self, logits, *args, **kwargs)

    Sampler.sample = counted
    try:
        got = summary(llm.beam_search(batch, params, concurrency_limit=3))
    finally:
        Sampler.sample = original
    assert draws == []
    for want, have in zip(expected, got, strict=True):
        assert_same_ranking(want, have)


def test_an_aborted_search_frees_its_whole_group(llm: LLM) -> None:
    """A search aborted while its members run (its client gone: the root's
    id, as a client aborts) ends every member and frees their blocks and
    the root's (the leak checks after the test); the engine serves on."""
    from vllm.inputs import TokensPrompt

    from vllm_kvreuse.beam.frontend import root_sampling_params

    scheduler = scheduler_of(llm)
    params = BeamSearchParams(beam_width=4, max_tokens=60, ignore_eos=True)
    prompt = TokensPrompt(
        prompt_token_ids=prompts(1, first_seed=7)[0]["prompt_token_ids"]
    )
    llm.llm_engine.add_request(
        "abort-search", prompt, root_sampling_params(params, None)
    )
    for _ in range(6):  # the root's prefill, the members' first steps, a few more
        llm.llm_engine.step()
    # The root has finished its step; its group's 4 members run.
    assert len(scheduler.requests) == 4, "the members should be running"
    llm.llm_engine.abort_request(["abort-search"])
    for _ in range(5):
        llm.llm_engine.step()
    assert not scheduler.requests, "members of an aborted search kept"
    assert not llm.llm_engine.has_unfinished_requests()
    (ok,) = llm.beam_search(prompts(1), BeamSearchParams(beam_width=2, max_tokens=2))
    assert len(ok.sequences) == 2
