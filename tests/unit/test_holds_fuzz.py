"""Randomised test of held requests: two features hold in the same steps.

A hypothesis state machine drives the real scheduler with every feature on
(:mod:`tests.unit.scheduler_driver`) and the chunk cache answering on paths
(``chunk_attention="paths"``), so two features hold requests out of vLLM's
queues through the core's one owner (:mod:`vllm_kvreuse.core.holds`): engine
beam search (a step that does not fit waits whole; a live member sits out
for its group) and answer paths (a chunked request waits for its paths'
scores, made-up prompt log-probs deciding them). Between them: plain
traffic, client aborts (between steps and while a batch runs), failures,
preemptions, cache-hit thresholds that reject held requests, and requests
that finish.

Checked after every step that scheduled: the requests held out of it came
back first in their queue, in the order they stood in, and the others kept
theirs (:func:`_assert_order`); every seat came back. After every action:
the block accounting, the chunk index, no finished request held or queued,
no request queued twice (``Driver.check``). At the end, after a drain and a
cache reset: every client answered once, nothing held, every block free.
The test also fails if the runs never exercised one of :data:`EXERCISED`.

The suite runs 150 derandomised examples; a longer random search::

    KVREUSE_HOLDS_EXAMPLES=2000 pytest tests/unit/test_holds_fuzz.py -s
"""

from __future__ import annotations

import os
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from vllm.config import ModelConfig

from tests.unit.conftest import make_request
from tests.unit.scheduler_driver import EOS, Driver, make_full_scheduler
from vllm_kvreuse.beam.rule import BeamConfig
from vllm_kvreuse.beam.scheduler.gate import REASON as STEP_DOES_NOT_FIT
from vllm_kvreuse.beam.scheduler.sit_out import REASON as SITS_OUT
from vllm_kvreuse.chunk_cache.paths.voting import REASON as WAITS_FOR_SCORES

SYSTEM = list(range(3000, 3008))
DOCS = [
    list(range(1000 + 200 * i, 1000 + 200 * i + n))
    for i, n in enumerate((16, 33, 50, 24))
]
THRESHOLDS = st.sampled_from([None, None, None, 0.5, 0.99])
DRAIN_STEPS = 400

EXERCISED = (
    "steps holding for both features",
    "held waiting beam members",
    "held running beam members",
    "held path requests",
    "held requests aborted or failed",
    "path decisions",
    "paths ABORT cache_threshold",
    "beam STOP beams",
    "two batches in flight",
)
"""What the suite's runs must have exercised, or the test is vacuous."""
SEEN: Counter[str] = Counter()
EXAMPLES = int(os.environ.get("KVREUSE_HOLDS_EXAMPLES", "0"))


def _ids(queue: object) -> list[str]:
    return [request.request_id for request in queue]  # type: ignore[attr-defined]


def _assert_order(
    queue: str, before: list[str], taken: list[str], after: list[str]
) -> None:
    """``taken`` (held out of the schedule) stood in ``before`` in that
    order; in ``after``, those still queued come first, in that order, then
    the others of ``before`` in theirs (requests new to the queue left out:
    spawned, preempted, admitted)."""
    position = {rid: i for i, rid in enumerate(before)}
    assert all(rid in position for rid in taken), (
        f"{queue}: held {taken} were not all queued before the step: {before}"
    )
    assert taken == sorted(taken, key=position.__getitem__), (
        f"{queue}: held {taken} out of their queue order {before}"
    )
    known = set(before)
    held = set(taken)
    expected = [rid for rid in taken if rid in after] + [
        rid for rid in before if rid not in held and rid in after
    ]
    assert [rid for rid in after if rid in known] == expected, (
        f"{queue}: before {before}, held {taken}, after {after}"
    )


class HoldsMachine(RuleBasedStateMachine):
    """Beams and answer paths holding requests in the same steps."""

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        self.model_config = model_config
        self.driver: Driver | None = None
        self.counter = 0
        self.seats = (0, 0)

    @property
    def d(self) -> Driver:
        assert self.driver is not None
        return self.driver

    def _id(self, kind: str) -> str:
        self.counter += 1
        return f"{kind}{self.counter}"

    def _question(self, length: int) -> list[int]:
        unique = 5000 + 100 * self.counter
        return list(range(unique, unique + length))

    @staticmethod
    def _extra(threshold: float | None) -> dict[str, object]:
        return {} if threshold is None else {"cache_hit_threshold": threshold}

    @initialize(
        num_blocks=st.sampled_from([12, 16, 24]),
        budget=st.sampled_from([32, 64, 256]),
        max_num_seqs=st.sampled_from([3, 4, 6]),
        async_scheduling=st.booleans(),
    )
    def build(
        self, num_blocks: int, budget: int, max_num_seqs: int, async_scheduling: bool
    ) -> None:
        scheduler = make_full_scheduler(
            self.model_config,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            async_scheduling=async_scheduling,
            chunk_attention="paths",
        )
        self.seats = (scheduler.max_num_running_reqs, scheduler.max_num_active_reqs)
        self.driver = Driver(scheduler)

    # -- arrivals ----------------------------------------------------------------

    @rule(
        doc=st.integers(0, 3),
        tail=st.integers(1, 24),
        width=st.integers(2, 3),
        max_tokens=st.integers(2, 4),
        threshold=THRESHOLDS,
    )
    def add_beam(
        self, doc: int, tail: int, width: int, max_tokens: int, threshold: float | None
    ) -> None:
        config = BeamConfig(width=width, max_tokens=max_tokens, eos_token_id=EOS)
        request = make_request(
            self._id("beam"), DOCS[doc] + self._question(tail), max_tokens=1,
            kvreuse_beam=config.to_dict(), **self._extra(threshold),
        )  # fmt: skip
        request.sampling_params.logprobs = 2 * width
        self.d.add(request, "beam")

    @rule(
        docs=st.lists(st.integers(0, 3), min_size=2, max_size=3, unique=True),
        question=st.integers(1, 12),
        max_tokens=st.integers(1, 4),
        threshold=THRESHOLDS,
    )
    def add_paths(
        self, docs: list[int], question: int, max_tokens: int, threshold: float | None
    ) -> None:
        chunks = [SYSTEM, *(DOCS[i] for i in docs)]
        prompt = [t for chunk in chunks for t in chunk] + self._question(question)
        request = make_request(
            self._id("paths"), prompt, max_tokens,
            kvreuse_chunks=[len(c) for c in chunks], **self._extra(threshold),
        )  # fmt: skip
        self.d.add(request, "paths")

    @rule(tail=st.integers(1, 40), max_tokens=st.integers(1, 6))
    def add_plain(self, tail: int, max_tokens: int) -> None:
        request = make_request(self._id("plain"), self._question(tail), max_tokens)
        self.d.add(request, "plain")

    # -- a client's and the engine's interventions -------------------------------

    def _count_if_held(self, request_id: str) -> None:
        if request_id in self.d.scheduler.kvreuse.holds:
            SEEN["held requests aborted or failed"] += 1

    @precondition(lambda self: self.driver and self.driver.open_clients())
    @rule(which=st.integers(0, 1000))
    def abort(self, which: int) -> None:
        open_clients = self.d.open_clients()
        request_id = open_clients[which % len(open_clients)]
        self._count_if_held(request_id)
        self.d.abort(request_id)

    @precondition(lambda self: self.driver and self.driver.scheduler.requests)
    @rule(which=st.integers(0, 1000))
    def fail(self, which: int) -> None:
        """Any request, internal ones (scoring requests, beam members) too,
        fails at the next safe point."""
        live = sorted(self.d.scheduler.requests)
        request_id = live[which % len(live)]
        self._count_if_held(request_id)
        self.d.scheduler.kvreuse.fail(request_id, "failed by the randomised test")
        self.d.log.append(f"fail {request_id}")

    @precondition(lambda self: self.driver and self.driver.running())
    @rule(which=st.integers(0, 1000))
    def preempt(self, which: int) -> None:
        running = self.d.running()
        self.d.preempt(running[which % len(running)])

    @rule(
        count=st.integers(1, 4),
        variant=st.integers(0, 2),
        eos=st.booleans(),
        abort_during=st.none() | st.integers(0, 1000),
    )
    def step(
        self, count: int, variant: int, eos: bool, abort_during: int | None
    ) -> None:
        for _ in range(count):
            self._checked_step(variant, eos, abort_during)
            abort_during = None

    def _checked_step(self, variant: int, eos: bool, abort_during: int | None) -> None:
        """One engine step; if it scheduled, the held requests' order."""
        d = self.d
        scheduler = d.scheduler
        waiting, running = _ids(scheduler.waiting), _ids(scheduler.running)
        num_steps = d.num_steps
        d.step(variant, eos, abort_during)
        assert (scheduler.max_num_running_reqs, scheduler.max_num_active_reqs) == (
            self.seats
        ), "a held request's seat did not come back"
        if d.num_steps == num_steps:
            return  # no schedule() this time (a batch's output only)
        holds = scheduler.kvreuse.holds
        taken_waiting, taken_running = holds.last_out
        _assert_order("waiting", waiting, taken_waiting, _ids(scheduler.waiting))
        _assert_order("running", running, taken_running, _ids(scheduler.running))
        _record_holds(holds.summary(), taken_running)

    # -- checks ------------------------------------------------------------------

    @invariant()
    def accounting_holds(self) -> None:
        if self.driver is not None:
            self.driver.check()

    def teardown(self) -> None:
        if self.driver is None:
            return
        self.d.drain(DRAIN_STEPS)
        self.d.check()
        self.d.scheduler.reset_prefix_cache(reset_connector=True)
        self.d.check_drained()
        SEEN.update(self.d.seen)
        SEEN["path decisions"] += self.d.scheduler.feature(
            "chunk_cache"
        ).voting.num_decided
        SEEN["runs"] += 1


def _record_holds(reasons: dict[str, int], taken_running: list[str]) -> None:
    """Adds what one schedule held to :data:`SEEN`."""
    if reasons.get(WAITS_FOR_SCORES) and (
        reasons.get(STEP_DOES_NOT_FIT) or reasons.get(SITS_OUT)
    ):
        SEEN["steps holding for both features"] += 1
    SEEN["held waiting beam members"] += reasons.get(STEP_DOES_NOT_FIT, 0)
    SEEN["held running beam members"] += len(taken_running)
    SEEN["held path requests"] += reasons.get(WAITS_FOR_SCORES, 0)


def test_held_requests_come_back_in_order_with_blocks_accounted(
    model_config: ModelConfig,
) -> None:
    """Beams and answer paths hold requests in the same steps, with aborts,
    failures and finishes in between: queue order, seats and blocks hold."""
    SEEN.clear()
    run_state_machine_as_test(
        lambda: HoldsMachine(model_config),
        settings=settings(
            max_examples=EXAMPLES or 150,
            stateful_step_count=40,
            deadline=None,
            derandomize=not EXAMPLES,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            print_blob=True,
        ),
    )
    print("\n".join(f"{count:8d} {what}" for what, count in sorted(SEEN.items())))
    missed = [what for what in EXERCISED if not SEEN[what]]
    assert not missed, f"the runs never exercised {missed}: widen the strategies"
