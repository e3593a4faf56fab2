"""The chunk-cache causes of the soak's stall (issue 14), each reproduced
deterministically on a real in-process engine.

``long_prefill_token_threshold=32`` makes a fill take one step per 32 tokens,
so a chunked request parks for its asynchronous load (vLLM's
``WAITING_FOR_REMOTE_KVS``) while its fills are still running: the state the
soak's clients see under load, without the load.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vllm import LLM, SamplingParams
from vllm.v1.request import Request, RequestStatus

from tests.integration.chunks import chunk_cache_llm, index_of
from tests.integration.conftest import num_free_blocks, scheduler_of
from vllm_kvreuse.chunk_cache.frontend import chunked_prompt

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
    token_ids, lengths = chunked_prompt(segments)
    params = SamplingParams(
        max_tokens=2, ignore_eos=True, extra_args={"kvreuse_chunks": lengths}
    )
    llm.llm_engine.add_request(request_id, {"prompt_token_ids": token_ids}, params)
    requests = scheduler_of(llm).requests
    # vLLM appends a suffix to the caller's id.
    return next(r for rid, r in requests.items() if rid.startswith(f"{request_id}-"))


def steps(llm: LLM, count: int) -> None:
    for _ in range(count):
        llm.llm_engine.step()


def test_a_parked_request_keeps_its_chunks_until_it_loads(llm) -> None:
    """A new chunk's reservation pin is released twice: when its fill
    finishes (``fill_finished``) and when the requester's plan is unpinned.
    After the first release, a chunk the parked requester still needs is
    evictable; the next arrival that needs room in the store evicts it, and
    the worker's pending load waits forever for a chunk no one will store
    again: the request stays parked, holding its blocks."""
    index = index_of(llm)
    parked = add(llm, "pins", [SYSTEM, DOC, QUESTION])
    steps(llm, 2)  # the system prompt's fill is done and stored, DOC's is not
    assert parked.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    system_key = scheduler_of(llm).connector.plans[parked.request_id].chunks[0].key
    entry = index.get(system_key)
    assert entry is not None and entry.ready
    pins = entry.pins
    # The store (204 tokens) holds SYSTEM + DOC (130); OTHER_DOC needs room.
    add(llm, "newcomer", [OTHER_DOC, QUESTION])
    steps(llm, 60)
    assert parked.status == RequestStatus.FINISHED_LENGTH_CAPPED, (
        f"parked request still {parked.status.name} after 60 steps; the chunk "
        f"it waits for had {pins} pins and is "
        f"{'still' if index.get(system_key) else 'no longer'} stored"
    )


def test_aborting_a_request_parked_for_its_chunks_frees_its_blocks(llm) -> None:
    """vLLM frees a request aborted in WAITING_FOR_REMOTE_KVS only once the
    connector reports its load finished (``finish_requests`` delays the
    free); the chunk connector cancels the load instead and never reports
    it, so the blocks and the request object stay forever."""
    scheduler = scheduler_of(llm)
    scheduler.chunk_cache_admin("clear")  # room for this test's chunks
    free = num_free_blocks(llm)
    system, doc = [t + 1000 for t in SYSTEM], [t + 1000 for t in DOC]
    parked = add(llm, "abort-parked", [system, doc, QUESTION])
    steps(llm, 1)
    assert parked.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    llm.llm_engine.abort_request(["abort-parked"])  # the caller's id, as a client
    assert parked.status == RequestStatus.FINISHED_ABORTED
    steps(llm, 20)  # its fills finish; nothing else runs
    assert parked.request_id not in scheduler.requests, "aborted request kept"
    assert num_free_blocks(llm) == free, "the aborted request's blocks leaked"
