"""The causes of issue 14's stall, as the randomised scheduler test judged them.

Found (fixed): each test replays the shrunk sequence hypothesis reported
(``test_scheduler_fuzz.py``) on a real scheduler with every feature on.
Ruled out by the redesign (a chunked request waits for its fills holding no
block): each test keeps the suspected sequence from coming back.
"""

from __future__ import annotations

from vllm.config import ModelConfig
from vllm.v1.engine import FinishReason

from tests.unit.conftest import make_request
from tests.unit.scheduler_driver import EOS, Driver, make_full_scheduler
from vllm_kvreuse.beam.policy import BeamConfig

QUESTION = list(range(9000, 9004))


def _chunked(request_id: str, doc: list[int], max_tokens: int = 2):
    return make_request(
        request_id, doc + QUESTION, max_tokens, kvreuse_chunks=[len(doc)]
    )


def _assert_holds_no_blocks(driver: Driver, request_id: str) -> None:
    manager = driver.scheduler.kv_cache_manager
    held = [
        single.req_to_blocks[request_id]
        for single in manager.coordinator.single_type_managers
        if single.req_to_blocks.get(request_id)
    ]
    assert not held, f"{request_id} holds blocks while it waits for its fills"


def _assert_answered(
    driver: Driver, *request_ids: str, reason: FinishReason = FinishReason.LENGTH
) -> None:
    for request_id in request_ids:
        finals = [out.finish_reason for out in driver.clients[request_id].finals]
        assert finals == [reason], f"{request_id}: final outputs {finals}"


# -- found ---------------------------------------------------------------------


def test_a_chunk_its_request_will_load_stays_stored(model_config: ModelConfig) -> None:
    """The fill's reservation pin was the only pin on a new chunk, and it went
    when the fill finished: the chunk was evictable before its request
    loaded it, and a newcomer's reservation evicted it; the request then
    waited for a chunk no fill would store again, for ever."""
    # 12 blocks: a store of 0.25 x 12 x 32 = 96 tokens, room for one of the docs.
    driver = Driver(
        make_full_scheduler(model_config, num_blocks=12, max_num_batched_tokens=256)
    )
    first_doc, second_doc = list(range(1000, 1070)), list(range(2000, 2050))
    driver.add(_chunked("first", first_doc), "chunked")
    driver.step()  # the fill computes and stores first_doc, then finishes
    (key,) = [chunk.key for chunk in driver.side.plans["first"].chunks]
    entry = driver.side.index.get(key)
    assert entry is not None and entry.ready, "the fill did not store the chunk"
    assert entry.pins == 1, f"first's chunk has {entry.pins} pins before its load"
    driver.add(_chunked("second", second_doc), "chunked")  # needs room in the store
    driver.check()
    driver.drain(max_steps=50)
    _assert_answered(driver, "first", "second")
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


def test_a_request_aborted_while_its_fills_run_leaves_nothing(
    model_config: ModelConfig,
) -> None:
    """Suspected: blocks of a request aborted while waiting for its load never
    returned. It waits without blocks now; its fill runs on and stores."""
    # A 32-token budget: the 70-token doc's fill takes three steps.
    driver = Driver(make_full_scheduler(model_config, max_num_batched_tokens=32))
    driver.add(_chunked("waiting", list(range(1000, 1070))), "chunked")
    driver.step()
    assert driver.side.fills, "the fill finished in one step; the test needs more"
    _assert_holds_no_blocks(driver, "waiting")
    driver.abort("waiting")
    driver.check()
    driver.drain(max_steps=20)
    driver.scheduler.reset_prefix_cache(reset_connector=True)
    driver.check_drained()


def test_a_preempted_chunked_request_waits_for_refills_without_blocks(
    model_config: ModelConfig,
) -> None:
    """Suspected: a circular wait. A chunked request preempted after its load,
    its chunk evicted meanwhile, needs a re-fill; a request at the head that
    fills the pool waits for blocks. The preempted request holds none while
    it waits, so the re-fill and the big request fit (3 + 8 of 11 blocks)."""
    driver = Driver(
        make_full_scheduler(model_config, num_blocks=12, max_num_batched_tokens=256)
    )
    driver.add(_chunked("chunked", list(range(1000, 1070)), max_tokens=8), "chunked")
    driver.step()  # the fill stores the chunk
    driver.step()  # the request loads it and computes its question
    assert driver.running() == ["chunked"]
    driver.scheduler.reset_prefix_cache(reset_connector=True)  # evicts the chunk
    assert not driver.side.index.entries
    driver.add(make_request("big", list(range(3000, 3240)), max_tokens=8), "plain")
    driver.preempt("chunked")
    assert driver.side.fills, "the preempted request's chunk is not filled again"
    _assert_holds_no_blocks(driver, "chunked")
    driver.check()
    driver.drain(max_steps=60)
    _assert_answered(driver, "chunked", "big")
    driver.scheduler.reset_prefix_cache(reset_connector=True)
    driver.check_drained()
