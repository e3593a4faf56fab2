"""The causes of issue 14's stall, as the randomised scheduler test judged them.

Found (fixed): each test replays the shrunk sequence hypothesis reported
(``test_scheduler_fuzz.py``) on a real scheduler with every feature on.
Ruled out by the redesigns (chunks computed in place, in their own request,
which never waits for another): each test keeps the suspected sequence from
coming back.
"""

from __future__ import annotations

from vllm.config import ModelConfig
from vllm.v1.engine import FinishReason

from tests.unit.conftest import make_request
from tests.unit.scheduler_driver import EOS, Driver, make_full_scheduler
from vllm_kvreuse.beam.rule import BeamConfig

QUESTION = list(range(9000, 9004))


def _chunked(request_id: str, doc: list[int], max_tokens: int = 2):
    return make_request(
        request_id, doc + QUESTION, max_tokens, kvreuse_chunks=[len(doc)]
    )


def _assert_answered(
    driver: Driver, *request_ids: str, reason: FinishReason = FinishReason.LENGTH
) -> None:
    for request_id in request_ids:
        finals = [out.finish_reason for out in driver.clients[request_id].finals]
        assert finals == [reason], f"{request_id}: final outputs {finals}"


# -- found ---------------------------------------------------------------------


def test_a_chunk_its_request_will_load_stays_stored(model_config: ModelConfig) -> None:
    """A stored chunk a waiting request plans to load holds that plan's pin
    until the load is built: a newcomer's reservation cannot evict it (it
    finds no room and only computes its chunk)."""
    # 12 blocks: a store of 0.25 x 12 x 32 = 96 tokens, room for one of the docs.
    driver = Driver(
        make_full_scheduler(model_config, num_blocks=12, max_num_batched_tokens=256)
    )
    first_doc, second_doc = list(range(1000, 1070)), list(range(2000, 2050))
    driver.add(_chunked("first", first_doc), "chunked")
    driver.drain(max_steps=10)  # computes and stores first_doc
    driver.add(_chunked("again", first_doc), "chunked")  # plans to load it
    (key,) = driver.side.plans["again"].loaded_keys
    entry = driver.side.store.index.get(key)
    assert entry is not None and entry.ready and entry.pins == 1
    driver.add(_chunked("second", second_doc), "chunked")  # needs room in the store
    assert driver.side.store.index.get(key) is entry, "a pinned chunk was evicted"
    driver.check()
    driver.drain(max_steps=50)
    _assert_answered(driver, "first", "again", "second")
    driver.scheduler.reset_prefix_cache(reset_connector=True)
    driver.check_drained()


def test_resetting_running_requests_releases_held_beams(
    model_config: ModelConfig,
) -> None:
    """``reset_prefix_cache(reset_running_requests=True)`` preempts every
    running request and then requires every block free, else raises (the
    utility call fails, everything preempted); a beam group's held blocks
    stayed held."""
    driver = Driver(make_full_scheduler(model_config))
    config = BeamConfig(width=2, max_tokens=3, eos_token_id=EOS)
    root = make_request(
        "root", list(range(100, 140)), max_tokens=1, kvreuse_beam=config.to_dict()
    )
    root.sampling_params.logprobs = 4
    driver.add(root, "beam")
    driver.step()  # the root's prefill: its blocks are held for its beams
    assert len(driver.scheduler.kvreuse.ledger) == 1
    assert driver.scheduler.reset_prefix_cache(
        reset_running_requests=True, reset_connector=True
    ), "the cache was not reset with every request preempted"
    driver.check()
    driver.drain(max_steps=50)
    _assert_answered(driver, "root", reason=FinishReason.STOP)
    driver.check_drained()


def test_a_live_group_is_not_preempted_while_its_last_member_runs(
    model_config: ModelConfig,
) -> None:
    """Two seats, async scheduling: a request ahead in the queue lets one
    member of a width-2 live group in before its sibling. The first samples
    and waits (it keeps its seat); its sibling runs; a request waiting for a
    seat counted as pressure, and the sampled member was preempted, while the
    sibling's output was in flight. Then the sibling sampled and waited, and
    was preempted in turn: the members swapped places for ever (found by
    the randomised test in CI)."""
    driver = Driver(
        make_full_scheduler(
            model_config,
            num_blocks=12,
            max_num_seqs=2,
            max_num_batched_tokens=32,
            async_scheduling=True,
        )
    )
    config = BeamConfig(width=2, max_tokens=3, eos_token_id=EOS)
    # "busy" holds the second seat until the root's prefill is done, so
    # "filler" is still ahead of the members when they are spawned.
    driver.add(make_request("busy", list(range(500, 516)), max_tokens=2), "plain")
    root = make_request(
        "root", list(range(100, 132)), max_tokens=1, kvreuse_beam=config.to_dict()
    )
    root.sampling_params.logprobs = 4
    driver.add(root, "beam")
    driver.add(make_request("filler", list(range(300, 316)), max_tokens=1), "plain")
    for _ in range(10):
        if "root-beam1-0" in driver.scheduler.requests:
            break
        driver.step()
    assert "root-beam1-0" in driver.scheduler.requests, "no live members spawned"
    driver.add(make_request("late", list(range(400, 417)), max_tokens=3), "plain")
    driver.check()
    driver.drain(max_steps=60)
    _assert_answered(driver, "busy", "filler", "late")
    _assert_answered(driver, "root", reason=FinishReason.STOP)
    driver.check_drained()


# -- ruled out -----------------------------------------------------------------


def test_a_request_aborted_while_computing_its_chunk_leaves_nothing(
    model_config: ModelConfig,
) -> None:
    """Suspected: blocks of a request aborted mid-prefill never returned, or
    its chunk stayed reserved for ever. Its reservation goes with it."""
    # A 32-token budget: the 70-token doc takes three steps.
    driver = Driver(make_full_scheduler(model_config, max_num_batched_tokens=32))
    driver.add(_chunked("computing", list(range(1000, 1070))), "chunked")
    driver.step()
    assert driver.side.plans["computing"].unsaved, "computed in one step already"
    driver.abort("computing")
    assert not driver.side.store.index.entries
    driver.check()
    driver.drain(max_steps=20)
    driver.scheduler.reset_prefix_cache(reset_connector=True)
    driver.check_drained()


def test_a_preempted_chunked_request_is_planned_again(
    model_config: ModelConfig,
) -> None:
    """A chunked request preempted after its chunk was stored, the chunk
    evicted meanwhile: planned again, it computes the chunk in place once
    more and stores it; a request at the head that fills the pool and it
    both finish (3 + 8 of 11 blocks)."""
    driver = Driver(
        make_full_scheduler(model_config, num_blocks=12, max_num_batched_tokens=256)
    )
    driver.add(_chunked("chunked", list(range(1000, 1070)), max_tokens=8), "chunked")
    driver.step()  # computes the chunk in place, stores it, answers its first token
    assert driver.running() == ["chunked"]
    assert driver.side.store.stats.saved == 1
    driver.scheduler.reset_prefix_cache(reset_connector=True)  # evicts the chunk
    assert not driver.side.store.index.entries
    driver.add(make_request("big", list(range(3000, 3240)), max_tokens=8), "plain")
    driver.preempt("chunked")
    assert driver.side.plans["chunked"].unsaved, "not planned to store it again"
    driver.check()
    driver.drain(max_steps=60)
    _assert_answered(driver, "chunked", "big")
    assert driver.side.store.stats.saved == 2
    driver.scheduler.reset_prefix_cache(reset_connector=True)
    driver.check_drained()
