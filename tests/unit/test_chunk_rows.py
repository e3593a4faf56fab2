"""A warm chunked request's prefill in one step, on a real scheduler.

The driver (``scheduler_driver.py``) checks after every step that the row
requests of a step are ended by the next and share their request's block
table, and the block accounting; these tests pin down when a request runs
as rows and when it runs one span a step.
"""

from __future__ import annotations

import pytest
from vllm.config import ModelConfig

from tests.unit.conftest import make_request
from tests.unit.scheduler_driver import ROW, Driver, make_full_scheduler

DOCS = [list(range(1000 + 200 * i, 1060 + 200 * i)) for i in range(3)]
QUESTION = list(range(9000, 9006))


def _chunked(request_id: str, docs: list[list[int]]):
    prompt = [t for doc in docs for t in doc] + QUESTION
    lengths = [len(doc) for doc in docs]
    return make_request(request_id, prompt, 2, kvreuse_chunks=lengths)


def _warm(model_config: ModelConfig, **kwargs) -> tuple[Driver, list[dict]]:
    """Stores the documents, then sends them in reverse order (every one
    moved: an 8-token head of each recomputed, then the tail); returns the
    driver and each step's scheduled tokens of the warm request and rows."""
    driver = Driver(
        make_full_scheduler(
            model_config, num_blocks=40, chunk_recompute_head=8, **kwargs
        )
    )
    driver.add(_chunked("cold", DOCS), "chunked")
    driver.drain(max_steps=20)
    driver.add(_chunked("warm", DOCS[::-1]), "chunked")
    steps = []
    while driver.scheduler.requests.get("warm") is not None:
        driver.step()
        scheduled = {r: n for r, n in driver.last_scheduled.items() if "warm" in r}
        if scheduled:
            steps.append(scheduled)
    driver.drain(max_steps=20)
    driver.scheduler.reset_prefix_cache(reset_connector=True)
    driver.check_drained()
    return driver, steps


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_warm_request_runs_as_rows_of_one_step(
    model_config: ModelConfig, async_scheduling: bool
) -> None:
    """Seats and budget to spare: its prefill is one step, the request's own
    row and one row request per earlier span, their tokens its whole."""
    driver, steps = _warm(
        model_config, max_num_batched_tokens=256, async_scheduling=async_scheduling
    )
    rows = steps[0]
    # The first chunk is never recomputed: the other two's heads are row
    # requests, the tail with the question is the request's own row.
    assert sorted(rows.values()) == [8, 8, 22 + len(QUESTION)]
    assert sum(1 for r in rows if ROW in r) == 2
    assert all(len(step) == 1 for step in steps[1:])  # then it decodes
    assert driver.seen["one-step prefills"] >= 1


def test_without_seats_or_budget_it_runs_one_span_a_step(
    model_config: ModelConfig,
) -> None:
    """One seat, or a budget below the rows' total: no rows, one span a step."""
    for kwargs in ({"max_num_seqs": 1}, {"max_num_batched_tokens": 32}):
        _, steps = _warm(model_config, **kwargs)
        assert not any(ROW in r for step in steps for r in step)
        assert sum(1 for step in steps if step.get("warm", 0) > 1) == 3
