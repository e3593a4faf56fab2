"""One forward pass for a segmented request: its computed spans as rows.

A warm chunked request alternates loaded regions and computed spans (heads
of moved documents, chunks the question picks, the tail, the question).
Each computed span must attend causally to everything before it, loaded or
computed. Run one span a step, that is one engine step a span: on a GPU each
step is host work and a pass through every layer whatever it computes, and
it was most of a warm request's time.

Here the whole remaining prefill runs in **one step**: every region is
loaded before the forward pass, and each computed span is a *query row* of
the step's batch over the request's one block table: a row computing
positions ``[a, b)`` is a sequence of ``b - a`` queries whose context is
``[0, b)``. Every attention backend writes a layer's KV for the whole batch
before that layer's attention reads it, so at every layer a row reads the
KV the earlier rows wrote in that layer: the same values, with the same
causality, as the multi-step prefill, on every backend and both runners
(the runners see rows as requests; no runner is patched).

The request's own row is its last span (it runs into the question and
samples the first token); the others are *row requests* the workers see as
new requests that share its block ids and are finished in the next step
(:meth:`~vllm_kvreuse.core.upstream.scheduler.Upstream.split_rows`). The
engine core's scheduler never knows them: it schedules the request for the
rows' total, from ``prompt length - total`` (:func:`first_position`), so
its token budget counts every row, its blocks cover the whole prompt, and
the blocks it hashes are exactly those the step writes.

A step is all or nothing: the rows must fit the step's token budget and
free runner rows (the scheduler's seats; each row request takes one for the
step). When they do not, the request runs the multi-step prefill from where
it stands (one span a step), which needs no extra rows.

Invariant: an armed request is scheduled for all its rows' tokens or none.
The chunk cache's ``cap_new_tokens`` answers all or nothing; no other
feature may cap a chunked request's prefill (beam search caps only its live
members, which are never chunked), since a part of the total from the
scheduler's position would compute tokens past regions not loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.sampling_params import SamplingParams

from vllm_kvreuse.chunk_cache.engine.plan import ChunkPlan
from vllm_kvreuse.chunk_cache.engine.recompute import Span, clip, merge

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from vllm_kvreuse.core.upstream.scheduler import Upstream


@dataclass(frozen=True, slots=True)
class Rows:
    """A request's one-pass step, decided before it is scheduled.

    ``real``: the positions ``[0, real)`` held KV before the step;
    ``rows``: the positions it computes, one query row each, sorted, the
    last running to the prompt's end; ``loads``: the regions it loads.
    """

    real: int
    rows: list[Span]
    loads: list[Span]

    @property
    def num_tokens(self) -> int:
        return sum(stop - start for start, stop in self.rows)

    @property
    def num_extra_rows(self) -> int:
        """Rows besides the request's own (each a row request)."""
        return len(self.rows) - 1

    def first_position(self, prompt_len: int) -> int:
        """Where the scheduler sees the request stand before the step: it
        schedules ``num_tokens`` from here to the prompt's end."""
        return prompt_len - self.num_tokens


def rows_from(plan: ChunkPlan, pos: int, prompt_len: int) -> Rows | None:
    """The one-pass step of ``plan`` from ``pos`` on; None when nothing is
    loaded past ``pos`` (the rest is one contiguous prefill already)."""
    loads = clip(plan.load_regions(), [(pos, plan.end)]) if pos < plan.end else []
    if not loads:
        return None
    spans = clip(plan.spans, [(pos, plan.end)])
    rows = merge([*spans, (plan.end, prompt_len)])
    return Rows(real=pos, rows=rows, loads=loads)


class Arming:
    """The one-pass steps armed for the schedule() in progress, and who
    lends their extra rows (``seats``: the feature; None, one span a step)."""

    def __init__(self, vllm_config: Any) -> None:
        sched = vllm_config.scheduler_config
        budget = sched.max_num_batched_tokens
        self._max_tokens = min(budget, sched.long_prefill_token_threshold or budget)
        self._enabled = vllm_config.speculative_config is None
        self.armed: dict[str, Rows] = {}
        self.seats: StepRows | None = None

    def allows(self, request: Request) -> bool:
        """Whether ``request``'s prefill may run in one step: rows compute
        no prompt log-probs for the spans they run."""
        return self._enabled and request.sampling_params.prompt_logprobs is None

    def arm(
        self, plan: ChunkPlan, request: Request, pos: int, admitting: bool
    ) -> Rows | None:
        """``request``'s one-pass step from ``pos``, armed for this
        schedule() if it fits the token budget and seats lend its rows."""
        if (armed := self.armed.get(request.request_id)) is not None:
            return armed
        if not plan.one_pass or self.seats is None:
            return None
        rows = rows_from(plan, pos, request.num_prompt_tokens)
        if rows is None or rows.num_tokens > self._max_tokens:
            return None
        if not self.seats.take(rows.num_extra_rows, admitting):
            return None
        self.armed[request.request_id] = rows
        return rows

    def take(self) -> dict[str, Rows]:
        """The steps armed for the schedule() that just ran."""
        armed, self.armed = self.armed, {}
        return armed


IN_FLIGHT_ATTR = "kvreuse_split_rows"
"""A scheduler output's own attribute: each request it split into rows and
the tokens those rows ran (:meth:`StepRows.settle` squares them)."""


class StepRows:
    """The scheduler side of one-pass steps, around each schedule(): lends
    free seats as rows, splits armed requests into rows once scheduled,
    ends the row requests a step later, and squares each split request's
    in-flight count when its step's output returns.

    Invariant: seats are lent only during a schedule() (:meth:`take`
    inside it, :meth:`give_back` right after it).
    """

    def __init__(self, upstream: Upstream) -> None:
        self._upstream = upstream
        self._lent = 0
        self._to_end: list[str] = []
        # Row requests compute KV; the one token each samples is dropped.
        self._params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def take(self, num_rows: int, admitting: bool) -> bool:
        """Lends ``num_rows`` free seats as runner rows for this schedule()
        (``admitting``: a waiting request takes a seat of its own too)."""
        upstream = self._upstream
        running = len(upstream.running_requests()) + int(admitting)
        if running + num_rows > upstream.seat_limit():
            return False
        upstream.borrow_seats(num_rows)
        self._lent += num_rows
        return True

    def give_back(self) -> None:
        if self._lent:
            self._upstream.return_seats(self._lent)
            self._lent = 0

    def split(self, output: SchedulerOutput, armed: dict[str, Rows]) -> list[str]:
        """Splits each armed request ``output`` scheduled whole into its
        rows; returns the ids of those it did not (to be disarmed)."""
        upstream = self._upstream
        if self._to_end:
            upstream.end_rows(output, self._to_end)
            self._to_end = []
        missed, settled = [], []
        for request_id, rows in armed.items():
            scheduled = output.num_scheduled_tokens.get(request_id)
            if scheduled != rows.num_tokens:
                missed.append(request_id)
                continue
            if not rows.num_extra_rows:
                continue  # it stands at its only row's start already
            request = upstream.requests[request_id]
            ids = upstream.split_rows(output, request, rows.rows, self._params)
            self._to_end += ids
            last = rows.rows[-1][1] - rows.rows[-1][0]
            settled.append((request_id, rows.num_tokens - last))
        if settled:  # on the output itself: settled when it comes back
            vars(output)[IN_FLIGHT_ATTR] = settled
        return missed

    def settle(self, output: SchedulerOutput) -> None:
        """``output``'s step came back: its split requests' in-flight counts
        drop the tokens their rows ran (upstream drops their own)."""
        for request_id, num_tokens in vars(output).pop(IN_FLIGHT_ATTR, ()):
            request = self._upstream.requests.get(request_id)
            if request is not None:
                self._upstream.settle_rows(request, num_tokens)

    @property
    def has_work(self) -> bool:
        return bool(self._to_end or self._lent)
