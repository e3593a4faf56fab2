"""The chunk-cache causes of the soak's stall (issue 14), each as a
deterministic regression test on a real in-process engine.

``long_prefill_token_threshold=32`` makes a prefill take one step per 32
tokens, so a chunked request computes its new chunks across several steps
before it loads the stored ones: the state the soak's clients saw under
load, without the load. Its stored chunks stay pinned until it loads them,
and what it reserved goes with it if it ends first.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vllm import LLM, SamplingParams
from vllm.v1.request import Request, RequestStatus

from tests.integration.chunks import chunk_cache_llm, index_of
from tests.integration.conftest import num_free_blocks, scheduler_of
from vllm_kvreuse.chunk_cache.frontend.segments import chunked_request

SYSTEM = list(range(100, 140))  # 40 tokens: 2 steps
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


def test_a_request_keeps_the_chunks_it_will_load_until_it_loads(llm) -> None:
    """A stored chunk a request will load after computing a new one stays
    pinned until its load is built: the next arrival needing room in the
    store cannot evict it (and only computes its own chunk)."""
    index = index_of(llm)
    add(llm, "first", [SYSTEM, DOC, QUESTION])
    steps(llm, 10)  # computes and stores SYSTEM and DOC
    other_system = [t + 2000 for t in SYSTEM]
    loading = add(llm, "pins", [other_system, DOC, QUESTION])
    steps(llm, 1)  # computes the first 32 tokens of its new system prompt
    assert loading.status == RequestStatus.RUNNING
    side = scheduler_of(llm).connector.scheduler_side
    (doc_key,) = side.plans[loading.request_id].loaded_keys
    entry = index.get(doc_key)
    assert entry is not None and entry.ready and entry.pins >= 1
    # The store (204 tokens) holds SYSTEM, DOC and the new system prompt's
    # reservation (170); OTHER_DOC needs room.
    add(llm, "newcomer", [OTHER_DOC, QUESTION])
    steps(llm, 60)
    assert loading.status == RequestStatus.FINISHED_LENGTH_CAPPED, (
        f"request still {loading.status.name} after 60 steps"
    )
    assert index.get(doc_key) is entry
    assert index.num_pinned == 0, "pins outlived their holders"


def test_aborting_a_request_computing_its_chunks_frees_everything(llm) -> None:
    """A request aborted while it computes its new chunks leaves nothing
    behind: no block, no pin, no reservation, no request object."""
    scheduler = scheduler_of(llm)
    scheduler.feature("chunk_cache").admin("clear")  # room for this test
    free = num_free_blocks(llm)
    system, doc = [t + 1000 for t in SYSTEM], [t + 1000 for t in DOC]
    computing = add(llm, "abort-computing", [system, doc, QUESTION])
    steps(llm, 1)
    assert computing.status == RequestStatus.RUNNING
    llm.llm_engine.abort_request(["abort-computing"])  # the caller's id, as a client
    assert computing.status == RequestStatus.FINISHED_ABORTED
    steps(llm, 5)
    assert computing.request_id not in scheduler.requests, "aborted request kept"
    assert num_free_blocks(llm) == free, "the aborted request's blocks leaked"
    assert index_of(llm).num_pinned == 0
    assert all(entry.ready for entry in index_of(llm).entries.values())
