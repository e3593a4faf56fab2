"""Retention and inheritance inside a real vLLM Scheduler (no engine, no model)."""

from __future__ import annotations

import time

from vllm.v1.request import RequestStatus

from tests.conftest import BLOCK_SIZE
from tests.unit.conftest import (
    make_request,
    num_free_blocks,
    run_to_completion,
    step,
)

PROMPT = list(range(300, 400))  # 100 tokens
OUTPUT = [7] * 5  # what the fake model samples
SUFFIX = [11, 12, 13]
# The parent computed KV for all but its last sampled token.
PARENT_COMPUTED = len(PROMPT) + len(OUTPUT) - 1  # 104: 3 full blocks + 8
CHILD_PROMPT = PROMPT + OUTPUT + SUFFIX


def retained_parent(scheduler, request_id: str = "p", prompt=PROMPT, **extra):
    request = make_request(
        request_id, prompt, max_tokens=len(OUTPUT), retain_kv=True, **extra
    )
    scheduler.add_request(request)
    run_to_completion(scheduler)
    return request


def child(request_id: str, parent_id: str = "p", prompt=CHILD_PROMPT, **extra):
    return make_request(
        request_id, prompt, max_tokens=3, kvreuse_parent=parent_id, **extra
    )


def block_ids(scheduler, request_id: str) -> list[int]:
    return scheduler.kv_cache_manager.get_block_ids(request_id)[0]


def test_finished_parent_keeps_its_computed_blocks(make_scheduler) -> None:
    scheduler = make_scheduler()
    free_at_start = num_free_blocks(scheduler)
    retained_parent(scheduler)
    entry = scheduler.kvreuse.ledger.get("p")
    assert entry is not None, "parent was not retained"
    assert len(entry.token_ids) == PARENT_COMPUTED
    assert entry.num_blocks == 4
    assert all(block.ref_cnt == 1 for block in entry.blocks[0]), "store holds one ref"
    assert num_free_blocks(scheduler) == free_at_start - 4
    scheduler.reset_prefix_cache()
    assert num_free_blocks(scheduler) == free_at_start


def test_child_prefills_only_suffix_plus_one_with_a_private_tail(
    make_scheduler,
) -> None:
    scheduler = make_scheduler()
    retained_parent(scheduler)
    parent_blocks = list(scheduler.kvreuse.ledger.get("p").blocks[0])
    scheduler.add_request(child("c"))
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"c": len(SUFFIX) + 1}
    child_blocks = block_ids(scheduler, "c")
    # Full blocks are shared by reference; the partial tail is copied.
    assert child_blocks[:3] == [b.block_id for b in parent_blocks[:3]]
    assert child_blocks[3] != parent_blocks[3].block_id
    copies = [tuple(c) for c in output.kv_cache_block_copies or []]
    assert copies == [(parent_blocks[3].block_id, child_blocks[3])]
    assert parent_blocks[0].ref_cnt == 2


def test_concurrent_children_never_share_a_written_block(make_scheduler) -> None:
    scheduler = make_scheduler()
    retained_parent(scheduler)
    for i in range(3):
        scheduler.add_request(child(f"c{i}", prompt=PROMPT + OUTPUT + [20 + i]))
    output, _ = step(scheduler)
    tails = [block_ids(scheduler, f"c{i}")[3] for i in range(3)]
    assert len(set(tails)) == 3
    assert sorted(dst for _, dst in output.kv_cache_block_copies) == sorted(tails)


def test_block_aligned_prefix_needs_no_copy(make_scheduler) -> None:
    scheduler = make_scheduler()
    prompt = list(range(500, 500 + 2 * BLOCK_SIZE - len(OUTPUT) + 1))
    retained_parent(scheduler, prompt=prompt)  # computes exactly 2 blocks
    scheduler.add_request(child("c", prompt=prompt + OUTPUT + SUFFIX))
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"c": len(SUFFIX) + 1}
    assert not output.kv_cache_block_copies


def test_salt_mismatch_inherits_nothing(make_scheduler) -> None:
    """Another tenant naming the parent gets no block (nor a prefix-cache hit)."""
    scheduler = make_scheduler()
    retained_parent(scheduler)
    scheduler.add_request(child("c", cache_salt="other-tenant"))
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"c": len(CHILD_PROMPT)}
    assert not output.kv_cache_block_copies


def test_no_blocks_leak_after_children_and_release(make_scheduler) -> None:
    scheduler = make_scheduler()
    free_at_start = num_free_blocks(scheduler)
    retained_parent(scheduler)
    for i in range(4):
        scheduler.add_request(child(f"c{i}", prompt=PROMPT + OUTPUT + [30 + i]))
    run_to_completion(scheduler)
    scheduler.reset_prefix_cache()
    assert num_free_blocks(scheduler) == free_at_start


def test_aborted_parent_is_not_retained(make_scheduler) -> None:
    scheduler = make_scheduler()
    request = make_request("p", PROMPT, max_tokens=50, retain_kv=True)
    scheduler.add_request(request)
    step(scheduler)
    scheduler.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    assert len(scheduler.kvreuse.ledger) == 0


def test_budget_releases_the_oldest_first(make_scheduler) -> None:
    # 63 usable blocks x 0.1 = 6 blocks: room for one 4-block parent.
    scheduler = make_scheduler(retain_kv_max_fraction=0.1)
    free_at_start = num_free_blocks(scheduler)
    retained_parent(scheduler, "p1")
    retained_parent(scheduler, "p2", prompt=list(range(600, 700)))
    assert "p1" not in scheduler.kvreuse.ledger and "p2" in scheduler.kvreuse.ledger
    assert num_free_blocks(scheduler) == free_at_start - 4


def test_parent_larger_than_the_budget_is_not_retained(make_scheduler) -> None:
    scheduler = make_scheduler(retain_kv_max_fraction=0.05)  # 3 blocks
    retained_parent(scheduler)
    assert len(scheduler.kvreuse.ledger) == 0


def test_ttl_expiry_releases_and_publishes_once(make_scheduler) -> None:
    scheduler = make_scheduler()
    free_at_start = num_free_blocks(scheduler)
    retained_parent(scheduler, retain_kv_ttl=0.01)
    time.sleep(0.02)
    assert scheduler.feature("continuation").release_expired() == 1
    assert num_free_blocks(scheduler) == free_at_start
    assert scheduler.has_requests(), "one step must publish the new KV usage"
    step(scheduler)
    assert not scheduler.has_requests()


def test_memory_pressure_releases_retained_parents(make_scheduler) -> None:
    scheduler = make_scheduler(num_blocks=16, retain_kv_max_fraction=1.0)
    for i in range(3):
        retained_parent(
            scheduler, f"p{i}", prompt=list(range(1000 * i, 1000 * i + 100))
        )
    assert len(scheduler.kvreuse.ledger) == 3  # 12 of 15 blocks
    big = make_request("big", list(range(5000, 5000 + 5 * BLOCK_SIZE)), max_tokens=1)
    scheduler.add_request(big)
    for _ in range(3):
        output, _ = step(scheduler)
        if output.num_scheduled_tokens:
            break
    assert "big" in output.num_scheduled_tokens, "retained KV starved a new request"
    assert len(scheduler.kvreuse.ledger) < 3
    assert "p0" not in scheduler.kvreuse.ledger, "the oldest parent goes first"


def test_inherited_tokens_count_for_the_cache_hit_threshold(make_scheduler) -> None:
    scheduler = make_scheduler(global_cache_hit_threshold=0.95)
    retained_parent(scheduler, cache_hit_threshold=0.0)
    scheduler.add_request(child("c"))
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"c": len(SUFFIX) + 1}
    assert scheduler.feature("admission").num_rejections == 0


def test_request_sharing_a_retained_prefix_extends_into_its_tail(
    make_scheduler,
) -> None:
    """Front-end beam search names no parent; each beam request still gets the
    parent's partial tail block (copied), found through its last full block."""
    scheduler = make_scheduler()
    retained_parent(scheduler)
    parent_blocks = scheduler.kvreuse.ledger.get("p").blocks[0]
    scheduler.add_request(make_request("beam", CHILD_PROMPT, max_tokens=3))
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"beam": len(SUFFIX) + 1}
    copies = [tuple(c) for c in output.kv_cache_block_copies or []]
    assert copies == [(parent_blocks[3].block_id, block_ids(scheduler, "beam")[3])]


def test_diverging_tail_is_not_extended(make_scheduler) -> None:
    scheduler = make_scheduler()
    retained_parent(scheduler)
    other = PROMPT[:96] + [1] * 12  # same full blocks, different tail tokens
    scheduler.add_request(make_request("other", other, max_tokens=1))
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"other": len(other) - 96}
    assert not output.kv_cache_block_copies


def test_engine_records_answer_other_api_servers(make_scheduler) -> None:
    """With several API servers the engine keeps what a child needs, keyed by
    the id the client knows, behind the client's cache_salt."""
    from vllm_kvreuse.continuation.records import RUNNING, FinishedRecords
    from vllm_kvreuse.continuation.remote import client_keys

    scheduler = make_scheduler()
    feature = scheduler.feature("continuation")
    feature.records = FinishedRecords(default_ttl=60.0)  # as with 2 API servers
    parent = make_request(
        "cmpl-7-0-abcd1234", PROMPT, max_tokens=len(OUTPUT), retain_kv=True,
        cache_salt="tenant-a",
    )  # fmt: skip
    scheduler.add_request(parent)
    assert feature.records.find(client_keys("cmpl-7", 0), "tenant-a") == RUNNING
    run_to_completion(scheduler)
    answer = feature.records.find(client_keys("cmpl-7", 0), "tenant-a")
    assert answer["engine_request_id"] == "cmpl-7-0-abcd1234"
    assert answer["prompt_token_ids"] + answer["output_token_ids"] == PROMPT + OUTPUT
    assert feature.records.find(client_keys("cmpl-7", 0), None) is None
    assert feature.records.find(client_keys("cmpl-7", 1), "tenant-a") is None
    scheduler.reset_prefix_cache()


def test_parent_released_under_pressure_stays_known_and_is_recomputed(
    make_scheduler,
) -> None:
    """Memory pressure takes a retained parent's blocks, never its record:
    another API server still finds it within its TTL, and its child
    recomputes what the prefix cache no longer holds."""
    from vllm_kvreuse.continuation.records import FinishedRecords
    from vllm_kvreuse.continuation.remote import client_keys

    scheduler = make_scheduler(num_blocks=16, retain_kv_max_fraction=1.0)
    feature = scheduler.feature("continuation")
    feature.records = FinishedRecords(default_ttl=60.0)  # as with 2 API servers
    parent_id = "cmpl-9-0-abcd1234"
    parent = make_request(
        parent_id, PROMPT, max_tokens=len(OUTPUT), retain_kv=True, retain_kv_ttl=5
    )
    scheduler.add_request(parent)
    run_to_completion(scheduler)
    assert parent_id in scheduler.kvreuse.ledger
    # Fills the rest of the pool: the step that cannot admit it is pressure.
    big = make_request("big", list(range(5000, 5000 + 12 * BLOCK_SIZE)), max_tokens=1)
    scheduler.add_request(big)
    run_to_completion(scheduler)
    assert parent_id not in scheduler.kvreuse.ledger, "pressure released the parent"
    answer = feature.records.find(client_keys("cmpl-9", 0), None)
    assert answer is not None and answer["engine_request_id"] == parent_id
    assert answer["prompt_token_ids"] + answer["output_token_ids"] == PROMPT + OUTPUT
    child = make_request("c", CHILD_PROMPT, max_tokens=1, kvreuse_parent=parent_id)
    scheduler.add_request(child)
    output, _ = step(scheduler)
    # Whatever the prefix cache still holds (whole blocks at most), the rest
    # is computed: the child runs, from fewer cached tokens than inheritance.
    assert child.num_computed_tokens == len(CHILD_PROMPT)
    assert output.num_scheduled_tokens["c"] > len(SUFFIX) + 1
    run_to_completion(scheduler)
