"""Extra rows: running requests a step runs that upstream's loop never walks.

A feature that steps many requests as one (a beam group's members) keeps
them out of upstream's ``schedule()`` (the core's holds take them out of
the running queue, seats and all) and adds their rows to the output after
it, as upstream schedules a decoding request: one token each, their
computed counts advanced, in flight until the step's output comes. When
it comes, upstream's ``update_from_output`` walks an output without them
(:meth:`ExtraRows.hidden`): no per-request output, no stop check, no token
appended; the feature applies the step itself. So the host's cost of an
extra request is a few list appends a step, not upstream's per-request
scheduling, bookkeeping and output.

Invariants:
- an extra row's request is running and in ``scheduler.requests``; its
  blocks cover the position it computes (``Upstream.reserve`` allocated
  them ahead; the new ids ride the next row);
- the token budget the rows take is lowered before ``schedule()``
  (:meth:`ExtraRows.borrow_tokens`) and restored right after it
  (:meth:`ExtraRows.return_tokens`, from the hook layer's ``finally``);
- an extra row counts in flight on its request exactly as upstream
  counts a scheduled token (``num_in_flight_tokens``, the deferred-free
  fence) and is settled when its output is hidden from upstream.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.output import NewRequestData

from vllm_kvreuse.core.upstream import requests as request_state

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

ROWS_ATTR = "kvreuse_extra_rows"
"""The scheduler output's extra request ids (set only here)."""


class ExtraRows:
    """The extra rows of one scheduler's steps."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._borrowed = 0
        self._previous: set[str] = set()
        self.supported = scheduler.parallel_config.pipeline_parallel_size == 1
        """Pipeline parallelism sends sampled tokens back with each row:
        extra rows do not (the workers keep their own)."""

    # -- around schedule() ---------------------------------------------------------

    def begin(self) -> None:
        """Right before ``schedule()``: notes which requests the previous
        step ran (upstream's set, its extra rows included), which
        ``schedule()`` overwrites with its own."""
        if not self._scheduler.use_v2_model_runner:
            self._previous = set(self._scheduler.prev_step_scheduled_req_ids)

    def ran_last_step(self, request_id: str) -> bool:
        """Whether the previous step ran the request (V2 workers need no
        resent token list: always True)."""
        return self._scheduler.use_v2_model_runner or request_id in self._previous

    def token_budget(self) -> int:
        """Tokens the next ``schedule()`` may schedule, less those borrowed."""
        return self._scheduler.max_num_scheduled_tokens

    def borrow_tokens(self, num: int) -> None:
        """Lowers the token budget of the ``schedule()`` to come by ``num``:
        the extra rows added after it take them."""
        self._scheduler.max_num_scheduled_tokens -= num
        self._borrowed += num

    def return_tokens(self) -> None:
        """Restores every borrowed token (right after ``schedule()``)."""
        self._scheduler.max_num_scheduled_tokens += self._borrowed
        self._borrowed = 0

    # -- the step's output ---------------------------------------------------------

    def add(
        self,
        output: SchedulerOutput,
        requests: Sequence[Request],
        new_blocks: dict[str, tuple[list[int], ...]],
        num_output_tokens: int | None = None,
        tables: Sequence[tuple[list[int], ...]] | None = None,
    ) -> None:
        """Adds one row per request to ``output``, computing its next
        position, with the block ids ``new_blocks`` names for it (taken);
        each request is advanced past it and counted in flight.
        ``num_output_tokens``: the output tokens each request has, when its
        own list is not kept (a group stepped as one keeps back-pointers).
        ``tables``: each request's block table when the workers do not know
        the requests yet (admitted outside ``schedule()``,
        :meth:`.scheduler.Upstream.admit`): each row is then a
        ``NewRequestData`` with it, as ``schedule()`` sends one it admits."""
        if not requests:
            return
        scheduler = self._scheduler
        v1 = not scheduler.use_v2_model_runner
        fence = scheduler.defer_block_free
        if fence and output.total_num_scheduled_tokens == 0:
            scheduler.sched_step_seq += 1  # upstream advances it for non-empty steps
        seq = scheduler.sched_step_seq if fence else None
        ids = [request.request_id for request in requests]
        if tables is not None:
            self._add_new(output, requests, tables, seq)
        else:
            self._add_cached(output, requests, ids, new_blocks, num_output_tokens, seq)
        output.num_scheduled_tokens.update(dict.fromkeys(ids, 1))
        output.total_num_scheduled_tokens += len(ids)
        # Cascade attention assumes every row shares those blocks.
        output.num_common_prefix_blocks = [0] * len(output.num_common_prefix_blocks)
        if v1:  # what the next begin() reads as the step's rows
            scheduler.prev_step_scheduled_req_ids.update(ids)
        vars(output).setdefault(ROWS_ATTR, set()).update(ids)  # its own attribute

    def _add_cached(
        self,
        output: SchedulerOutput,
        requests: Sequence[Request],
        ids: list[str],
        new_blocks: dict[str, tuple[list[int], ...]],
        num_output_tokens: int | None,
        seq: int | None,
    ) -> None:
        """The rows of requests the workers hold: cached rows."""
        cached = output.scheduled_cached_reqs
        v1 = not self._scheduler.use_v2_model_runner
        if v1 and not self._previous.issuperset(ids):
            # As upstream: a row the last step did not run comes whole.
            for request in requests:
                if request.request_id not in self._previous:
                    cached.all_token_ids[request.request_id] = list(
                        request.all_token_ids
                    )
        # Output tokens the workers hold: those appended, and a sample per
        # step in flight (upstream counts its own as placeholders; an extra
        # row's only as in flight; both are in flight). Fewer, and a V1
        # runner would cut its own list.
        outputs = [
            (r.num_output_tokens if num_output_tokens is None else num_output_tokens)
            + r.num_in_flight_tokens
            for r in requests
        ]
        positions = request_state.run_one_each(requests, seq)
        blocks: list[tuple[list[int], ...] | None] = [None] * len(ids)
        if new_blocks:
            blocks = [new_blocks.pop(rid, None) for rid in ids]
        _append_cached_rows(cached, ids, blocks, positions, outputs)

    def _add_new(
        self,
        output: SchedulerOutput,
        requests: Sequence[Request],
        tables: Sequence[tuple[list[int], ...]],
        seq: int | None,
    ) -> None:
        """The rows of requests the workers do not know: each sent whole
        (its block table, from the position it stands at), then advanced
        past it."""
        v2 = self._scheduler.use_v2_model_runner  # V2 takes the token list
        output.scheduled_new_reqs += [
            NewRequestData.from_request(r, table, list(r.all_token_ids) if v2 else None)
            for r, table in zip(requests, tables, strict=True)
        ]
        request_state.run_one_each(requests, seq)

    def hidden(self, output: SchedulerOutput) -> SchedulerOutput:
        """``output`` as upstream's ``update_from_output`` walks it: without
        its extra rows, whose requests are no longer in flight."""
        rows: set[str] | None = getattr(output, ROWS_ATTR, None)
        if not rows:
            return output
        requests = self._scheduler.requests
        request_state.settle_one_each(
            r for r in map(requests.get, rows) if r is not None
        )
        scheduled = output.num_scheduled_tokens
        if scheduled.keys() <= rows:  # a step of extra rows alone
            scheduled = {}
        else:
            scheduled = {rid: n for rid, n in scheduled.items() if rid not in rows}
        return dataclasses.replace(output, num_scheduled_tokens=scheduled)


def _append_cached_rows(
    cached: Any,
    req_ids: list[str],
    new_block_ids: list[tuple[list[int], ...] | None],
    num_computed_tokens: list[int],
    num_output_tokens: list[int],
) -> None:
    """Appends rows to a ``CachedRequestData`` (no pipeline parallelism:
    no new token ids), each parallel list by name."""
    cached.req_ids += req_ids
    cached.new_block_ids += new_block_ids
    cached.num_computed_tokens += num_computed_tokens
    cached.num_output_tokens += num_output_tokens


def extra_rows(output: Any) -> set[str]:
    """The extra request ids of a scheduler output."""
    return getattr(output, ROWS_ATTR, None) or set()
