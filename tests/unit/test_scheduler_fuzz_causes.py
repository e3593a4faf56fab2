"""What the randomised scheduler test found, each as its minimal sequence.

Each test replays the shrunk sequence of actions hypothesis reported (see
``test_scheduler_fuzz.py``) on a real scheduler with every feature on.
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


def _assert_answered(
    driver: Driver, *request_ids: str, reason: FinishReason = FinishReason.LENGTH
) -> None:
    for request_id in request_ids:
        finals = [out.finish_reason for out in driver.clients[request_id].finals]
        assert finals == [reason], f"{request_id}: final outputs {finals}"


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
