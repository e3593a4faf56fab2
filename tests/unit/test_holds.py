"""The one owner of requests held out of vLLM's queues (``core/holds.py``),
on real schedulers: what it takes out, what it puts back and in which
order, that it never holds a finished request, and that it is the only
code that moves requests out of vLLM's queues for holding."""

from __future__ import annotations

import ast
from pathlib import Path

from vllm.config import ModelConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

import vllm_kvreuse
from tests.unit.conftest import SchedulerFactory, make_request, step
from tests.unit.scheduler_driver import Driver, make_full_scheduler

PACKAGE = Path(vllm_kvreuse.__file__).parent
OWNER = PACKAGE / "core" / "holds.py"
SEAM = PACKAGE / "core" / "upstream" / "scheduler.py"


def _ids(requests: object) -> list[str]:
    return [r.request_id for r in requests]  # type: ignore[attr-defined]


def _holds(scheduler: Scheduler):
    return scheduler.kvreuse.holds  # type: ignore[attr-defined]


def test_held_waiting_requests_sit_out_and_come_back_first_in_their_order(
    make_scheduler: SchedulerFactory,
) -> None:
    """Two reasons hold two waiting requests out of a schedule; they come
    back at the head of the queue in the order they stood in, whichever
    reason was asked first."""
    scheduler = make_scheduler()
    for name in "abcd":
        scheduler.add_request(make_request(name, list(range(100, 140))))
    requests = scheduler.requests
    scheduler.max_num_running_reqs = scheduler.max_num_active_reqs = 1  # one seat
    holds = _holds(scheduler)
    assert holds.hold(requests["d"], "second feature")
    assert holds.hold(requests["b"], "first feature")
    output, _ = step(scheduler)
    assert list(output.num_scheduled_tokens) == ["a"], "held requests scheduled"
    assert holds.last_out == (["b", "d"], [])
    assert holds.summary() == {"first feature": 1, "second feature": 1}
    assert _ids(scheduler.waiting) == ["b", "d", "c"]
    holds.unhold("b", "first feature")
    holds.unhold_all("second feature")
    assert not len(holds)


def test_a_held_running_request_keeps_its_seat_and_comes_back_at_the_head(
    make_scheduler: SchedulerFactory,
) -> None:
    """A running request held for a step is out of the running queue with
    its seat, and first in it again after the step."""
    scheduler = make_scheduler()
    for name in "ab":
        scheduler.add_request(make_request(name, list(range(100, 140)), 8))
    step(scheduler)
    seats = (scheduler.max_num_running_reqs, scheduler.max_num_active_reqs)
    holds = _holds(scheduler)
    holds.hold(scheduler.requests["b"], "sits out")
    output, _ = step(scheduler)
    assert list(output.num_scheduled_tokens) == ["a"]
    assert _ids(scheduler.running) == ["b", "a"]
    assert (scheduler.max_num_running_reqs, scheduler.max_num_active_reqs) == seats


def test_each_reason_releases_its_own_holds_and_the_summary_is_the_steps(
    make_scheduler: SchedulerFactory,
) -> None:
    """``unhold_all`` gives up one reason's holds and no other's; a
    request freed while held is no reason's any more; what the last
    ``schedule()`` kept out is read as it stood then, not as the holds
    changed since."""
    scheduler = make_scheduler()
    for name in "abc":
        scheduler.add_request(make_request(name, list(range(100, 140))))
    requests, holds = scheduler.requests, _holds(scheduler)
    holds.hold(requests["a"], "one")
    holds.hold(requests["a"], "two")
    holds.hold(requests["b"], "one")
    holds.hold(requests["c"], "two")
    step(scheduler)
    holds.unhold_all("one")
    assert _ids(holds.held()) == ["a", "c"]
    assert holds.last_out == (["a", "b", "c"], [])
    assert holds.summary() == {"one": 2, "two": 2}
    scheduler.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    holds.hold(requests["b"], "two")
    holds.unhold_all("two")
    assert not len(holds), "a reason's hold outlived unhold_all"
    holds.unhold_all("one")  # nothing left: a no-op
    output, _ = step(scheduler)
    assert set(output.num_scheduled_tokens) == {"a", "b"}


def test_a_finished_request_is_never_held(make_scheduler: SchedulerFactory) -> None:
    """Refused once finished, and forgotten when freed."""
    scheduler = make_scheduler()
    request = make_request("r", list(range(100, 140)))
    scheduler.add_request(request)
    holds = _holds(scheduler)
    assert holds.hold(request, "waits")
    scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert "r" not in holds
    assert not holds.hold(request, "waits")
    step(scheduler)
    assert holds.last_out == ([], [])


def test_a_parked_request_finished_before_the_schedule_stays_out_of_the_queue(
    model_config: ModelConfig,
) -> None:
    """a6ec2c5's cause: a chunked request waiting for its answer paths'
    scores was parked out of the queue by the chunk cache's
    ``before_schedule``, then rejected by the cache-hit threshold's in the
    same step, and put back into the queue finished after the schedule;
    the next ``schedule()`` killed the engine core. Holds leave the queue
    only after every ``before_schedule``, and a finished request is never
    held or put back."""
    driver = Driver(
        make_full_scheduler(
            model_config, chunk_attention="paths", max_num_batched_tokens=256
        )
    )
    system, docs = list(range(3000, 3010)), [list(range(1000, 1040))] * 2
    docs[1] = list(range(2000, 2040))
    prompt = system + docs[0] + docs[1] + list(range(9000, 9004))
    request = make_request(
        "rejected", prompt, 2, kvreuse_chunks=[10, 40, 40], cache_hit_threshold=0.99
    )
    driver.add(request, "chunked")
    driver.step()
    scheduler = driver.scheduler
    queued = [*scheduler.waiting, *scheduler.running]
    finished = [r.request_id for r in queued if r.is_finished()]
    assert not finished, f"finished requests back in the queue: {finished}"
    driver.drain(max_steps=20)
    finals = driver.clients["rejected"].finals
    assert [out.finish_reason for out in finals] == [FinishReason.ABORT]
    driver.check()
    scheduler.reset_prefix_cache(reset_connector=True)
    driver.check_drained()


def test_a_request_waiting_for_a_score_that_never_comes_runs_jointly(
    model_config: ModelConfig,
) -> None:
    """A path's scoring request the engine finishes itself (a failure) sends
    no output: its request gives up its paths, is held no more, and runs
    jointly instead of waiting for that score for ever."""
    driver = Driver(
        make_full_scheduler(
            model_config, chunk_attention="paths", max_num_batched_tokens=256
        )
    )
    system, first, second = (list(range(n, n + 24)) for n in (3000, 1000, 2000))
    prompt = system + first + second + list(range(9000, 9004))
    driver.add(make_request("r", prompt, 2, kvreuse_chunks=[24, 24, 24]), "chunked")
    scheduler = driver.scheduler
    assert "r" in _holds(scheduler)
    scoring = sorted(rid for rid in scheduler.requests if rid != "r")
    scheduler.kvreuse.fail(scoring[0], "a hook raised on it")
    driver.drain(max_steps=30)
    finals = driver.clients["r"].finals
    assert [out.finish_reason for out in finals] == [FinishReason.LENGTH]
    assert scheduler.feature("chunk_cache").voting.num_decided == 0
    scheduler.reset_prefix_cache(reset_connector=True)
    driver.check_drained()


def _callers(path: Path, names: set[str]) -> list[str]:
    """Where ``path`` calls a method named in ``names`` (``x.name(...)``)."""
    tree = ast.parse(path.read_text())
    return [
        f"{path.relative_to(PACKAGE)}:{node.lineno} .{node.func.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in names
    ]


def test_only_the_owner_moves_requests_out_of_the_queues_for_holding() -> None:
    """The seam's holding steps (``Upstream.take_out_of_queues`` and
    ``put_back_into_queues``) have one caller, ``core/holds.py``; the
    queues' own edits are the seam's alone (``test_private_access.py``):
    those two, and ``Upstream.admit`` (requests a feature admits leave the
    waiting queue for good, as ``schedule()`` admits one)."""
    steps = {"take_out_of_queues", "put_back_into_queues"}
    callers = [
        where
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in (OWNER, SEAM)
        for where in _callers(path, steps)
    ]
    assert callers == [], "hold through core.holds instead"
    assert len(_callers(OWNER, steps)) == 2, "the owner's calls are gone"
    edits = _callers(SEAM, {"remove_requests", "prepend_requests"})
    assert len(edits) == 3, f"the seam's queue edits: {edits}"
