"""The chunk-cache causes of the soak's stall (issue 14), each as a
deterministic regression test on a real in-process engine.

``long_prefill_token_threshold=32`` makes a fill take one step per 32
tokens, so a chunked request waits for its fills across several steps: the
state the soak's clients saw under load, without the load. Before the fix a
waiting request sat in vLLM's ``WAITING_FOR_REMOTE_KVS`` holding blocks; now
it waits in the queue holding none, and its chunks stay pinned until it
loads.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vllm import LLM, SamplingParams
from vllm.v1.request import Request, RequestStatus

from tests.integration.chunks import chunk_cache_llm, index_of
from tests.integration.conftest import num_free_blocks, scheduler_of
from vllm_kvreuse.chunk_cache.frontend import chunked_request

SYSTEM = list(range(100, 140))  # 40 tokens: its fill takes 2 steps
DOC = list(range(200, 290))  # 90 tokens: 3 steps
QUESTION = list(range(400, 410))
OTHER_DOC = list(range(600, 700))  # 100 tokens


@pytest.fixture(scope="module")
def llm(model_dir: str) -> Iterator[LLM]:
    # 64 blocks: a chunk store of 0.1 x 64 x 32 = 204 tokens.
    with chunk_cache_llm(
        model_dir, num_gpu_blocks_override=64, long_prefill_token_threshold=32
    ) as engine:
        yield engine


def add(llm: LLM, request_id: str, segments: list[list[int]]) -> Request:
    """Adds a chunked request; returns the scheduler's request."""
    prompt, extra_args = chunked_request(segments)
    params = SamplingParams(max_tokens=2, ignore_eos=True, extra_args=extra_args)
    llm.llm_engine.add_request(request_id, prompt, params)
    requests = scheduler_of(llm).requests
    # vLLM appends a suffix to the caller's id.
    return next(r for rid, r in requests.items() if rid.startswith(f"{request_id}-"))


def steps(llm: LLM, count: int) -> None:
    for _ in range(count):
        llm.llm_engine.step()


def test_a_waiting_request_keeps_its_chunks_until_it_loads(llm) -> None:
    """A new chunk's pin was released twice (by its fill and by the plan), so
    a chunk a waiting request still needed could be evicted by the next
    arrival, and the request waited forever. Now the plan holds a pin of its
    own until it loads."""
    index = index_of(llm)
    waiting = add(llm, "pins", [SYSTEM, DOC, QUESTION])
    steps(llm, 2)  # the system prompt's fill is done and stored, DOC's is not
    assert waiting.status == RequestStatus.WAITING
    assert not scheduler_of(llm).kv_cache_manager.get_block_ids(waiting.request_id)[
        0
    ], "a request waiting for its chunks must hold no block"
    side = scheduler_of(llm).connector.scheduler_side
    system_key = side.plans[waiting.request_id].chunks[0].key
    entry = index.get(system_key)
    assert entry is not None and entry.ready and entry.pins >= 1
    # The store (204 tokens) holds SYSTEM + DOC (130); OTHER_DOC needs room.
    add(llm, "newcomer", [OTHER_DOC, QUESTION])
    steps(llm, 60)
    assert waiting.status == RequestStatus.FINISHED_LENGTH_CAPPED, (
        f"request still {waiting.status.name} after 60 steps; the chunk it "
        f"waits for is {'still' if index.get(system_key) else 'no longer'} stored"
    )
    assert index.num_pinned == 0, "pins outlived their holders"


def test_aborting_a_request_waiting_for_its_chunks_frees_everything(llm) -> None:
    """A request aborted while it waits for its fills leaves nothing behind:
    no block (it holds none), no pin, no request object."""
    scheduler = scheduler_of(llm)
    scheduler.feature("chunk_cache").admin("clear")  # room for this test
    free = num_free_blocks(llm)
    system, doc = [t + 1000 for t in SYSTEM], [t + 1000 for t in DOC]
    waiting = add(llm, "abort-waiting", [system, doc, QUESTION])
    steps(llm, 1)
    assert waiting.status == RequestStatus.WAITING
    llm.llm_engine.abort_request(["abort-waiting"])  # the caller's id, as a client
    assert waiting.status == RequestStatus.FINISHED_ABORTED
    steps(llm, 20)  # its fills finish; nothing else runs
    assert waiting.request_id not in scheduler.requests, "aborted request kept"
    assert num_free_blocks(llm) == free, "the aborted request's blocks leaked"
    assert index_of(llm).num_pinned == 0
