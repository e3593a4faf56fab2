"""The seam to the engine core's scheduler: its KV pool and queues.

Every read and write of upstream scheduler, KV-cache-manager and
scheduler-output state that the features and services need, beyond what a
public upstream method does for them, is made here: the block tables and
their copy-on-write queue, the running and waiting queues and the seat
limits, the step output's parallel lists. A request's own private state is
:mod:`.requests`'s (reached through :class:`Upstream` as well). The
services (:mod:`vllm_kvreuse.core.resend`, :mod:`vllm_kvreuse.core.ledger`)
and the features call these methods; they decide, this module applies.
Each attribute is registered in
:data:`vllm_kvreuse.patches.upstream_state.UPSTREAM_STATE`.

Invariants (ownership, as upstream keeps it):
- A block table change moves references, never counts them by hand: a
  table entry is one reference, a queued copy's two endpoints one each
  until upstream's next ``schedule()`` drains the queue.
- Requests leave vLLM's queues for holding only through
  :meth:`Upstream.take_out_of_queues`, undone by
  :meth:`Upstream.put_back_into_queues` around a
  single ``schedule()``; :class:`vllm_kvreuse.core.holds.Holds` is the only
  caller of either.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.request import Request

from vllm_kvreuse.core.upstream import requests as request_state

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler


class Upstream:
    """One scheduler's internal state, read and changed through named steps."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._manager = scheduler.kv_cache_manager
        self._pool = self._manager.block_pool
        self.block_size = scheduler.block_size
        self.hash_block_size = scheduler.cache_config.hash_block_size or self.block_size
        self.v2 = scheduler.use_v2_model_runner
        self._num_rows = 0  # row requests made (their ids are unique)

    # -- the block pool ----------------------------------------------------------

    @property
    def num_pool_blocks(self) -> int:
        """Blocks of the pool, the null block included."""
        return self._pool.num_gpu_blocks

    def num_free_blocks(self) -> int:
        return self._pool.get_num_free_blocks()

    def pool_blocks(self) -> list[Any]:
        """Every block of the pool, the null block included (read only)."""
        return self._pool.blocks

    def reference(self, blocks: Iterable[Any]) -> None:
        """Takes one reference on each block (a free one leaves the queue)."""
        self._pool.touch(blocks)

    def free(self, blocks: Iterable[Any]) -> None:
        """Drops one reference on each, in the given order (pass tails first:
        the free queue evicts in that order)."""
        self._pool.free_blocks(blocks)

    def blocks_are_positional(self) -> bool:
        """Full attention in every KV-cache group and prefix caching on: a
        block holds the same positions for everyone, so it can be handed over."""
        groups = self._manager.kv_cache_config.kv_cache_groups
        return self._manager.enable_caching and all(
            type(group.kv_cache_spec) is FullAttentionSpec
            and group.kv_cache_spec.block_size == self.block_size
            for group in groups
        )

    def lookup_enabled(self, request: Request) -> bool:
        """Whether upstream would look ``request`` up in the prefix cache."""
        return self._manager.prefix_cache_lookup_enabled(request)

    # -- block tables --------------------------------------------------------------

    def blocks_of(self, request_id: str) -> tuple[list[Any], ...]:
        """The request's block table in each group (upstream's lists)."""
        return self._manager.get_blocks(request_id).blocks

    def block_ids_of(self, request_id: str) -> tuple[list[int], ...]:
        return block_ids(self._manager, request_id)

    def reserve(
        self, request: Request, num_tokens: int
    ) -> tuple[list[int], ...] | None:
        """Allocates the blocks of the request's next ``num_tokens``
        positions now, kept out of the prefix cache (rows that change
        content: :mod:`.extra_rows`); the new ids per KV-cache group, or
        None if the pool cannot give them all."""
        blocks = self._manager.allocate_slots(
            request, num_tokens, delay_cache_blocks=True
        )
        return None if blocks is None else blocks.get_block_ids()

    def admit(self, hits: list[tuple[Request, Any, int]], num_positions: int) -> bool:
        """Admits waiting requests as ``schedule()`` admits one with a prefix
        hit, ``(request, hit blocks, hit tokens)``: each gets its blocks up
        to position ``num_positions`` (as :meth:`reserve`'s; a tail copied on
        write by the next ``schedule()``) and runs, at the running queue's
        tail. All or nothing: False, nothing changed, if the pool cannot
        give them all or a KV connector must be told of each."""
        if self._scheduler.connector is not None:
            return False
        done = []
        for request, blocks, num_hit in hits:
            num_new = num_positions - num_hit
            if not self._manager.allocate_slots(
                request, num_new, num_hit, blocks, delay_cache_blocks=True
            ):
                for undone in reversed(done):  # queued copies keep their ends
                    self._manager.free(undone)
                return False
            done.append(request)
        for request, _, num_hit in hits:
            request_state.admitted(request, num_hit)
        self._scheduler.waiting.remove_requests(done)
        self._scheduler.running += done
        return True

    # -- requests (:mod:`.requests`) -----------------------------------------------

    retoken = staticmethod(request_state.retoken)
    rehash = staticmethod(request_state.rehash)
    hasher_of = staticmethod(request_state.hasher_of)
    move_computed = staticmethod(request_state.move_computed)
    settle_rows = staticmethod(request_state.settle_rows)
    history = staticmethod(request_state.history)
    adopt = staticmethod(request_state.adopt)
    rewrite = staticmethod(request_state.rewrite)

    def unsample(self, request: Request) -> None:
        """Takes back the request's last sampled token (:func:`.requests.unsample`)."""
        request_state.unsample(request, self.hash_block_size)

    # -- queues and seats ----------------------------------------------------------

    @property
    def requests(self) -> dict[str, Request]:
        """The scheduler's requests by id (upstream's dict: read only)."""
        return self._scheduler.requests

    def running_requests(self) -> list[Request]:
        """The running queue (upstream's list: read, do not change)."""
        return self._scheduler.running

    def waiting_requests(self) -> Iterable[Request]:
        """The waiting queue, in order (read, do not change)."""
        return self._scheduler.waiting

    def num_waiting(self) -> int:
        """Requests waiting, those holding KV for a connector included."""
        scheduler = self._scheduler
        return len(scheduler.waiting) + len(scheduler.kv_holding_waiting)

    def free_seats(self) -> int:
        """Running seats a step could still fill."""
        return self._scheduler.max_num_active_reqs - len(self._scheduler.running)

    def seat_limit(self) -> int:
        """Requests that may run at once (``max_num_seqs``, pipeline-capped)."""
        scheduler = self._scheduler
        return min(scheduler.max_num_running_reqs, scheduler.max_num_active_reqs)

    def borrow_seats(self, num: int) -> None:
        """Lowers the seat limits by ``num`` for the schedule() in progress:
        the runner rows they stand for carry a request's extra query rows
        (:meth:`split_rows`); :meth:`return_seats` undoes it after it."""
        self._scheduler.max_num_running_reqs -= num
        self._scheduler.max_num_active_reqs -= num

    def return_seats(self, num: int) -> None:
        self._scheduler.max_num_running_reqs += num
        self._scheduler.max_num_active_reqs += num

    def preempt(self, requests: list[Request]) -> None:
        """Preempts running ``requests`` as upstream does (out of the running
        queue, blocks freed, back to waiting). Only for requests this step
        did not schedule."""
        scheduler = self._scheduler
        scheduler.running[:] = [r for r in scheduler.running if r not in requests]
        now = time.monotonic()
        for request in requests:
            scheduler._preempt_request(request, now)

    # -- holding (for :class:`vllm_kvreuse.core.holds.Holds` alone) ---------------

    def take_out_of_queues(
        self, held: Mapping[str, tuple[Request, Any]]
    ) -> tuple[list[Request], list[Request]]:
        """Takes the ``held`` requests (id -> (request, reasons)) out of the
        waiting and running queues for one ``schedule()``, a running one with
        its seat; returns each queue's, in queue order. One in neither queue
        stays where it is. :meth:`put_back_into_queues` undoes it."""
        scheduler = self._scheduler
        waiting, _ = request_state.split_held(scheduler.waiting, held)
        if waiting:
            scheduler.waiting.remove_requests(waiting)
        running, kept = request_state.split_held(scheduler.running, held)
        if running:
            scheduler.running[:] = kept
            scheduler.max_num_running_reqs -= len(running)
            scheduler.max_num_active_reqs -= len(running)
        return waiting, running

    def put_back_into_queues(
        self, waiting: list[Request], running: list[Request]
    ) -> None:
        """Returns what :meth:`take_out_of_queues` took, each queue's in its order: the
        waiting ones to the head of the waiting queue, the running ones (they
        sat this step out: last to be preempted) to the head of the running
        queue, and every seat. One finished meanwhile stays out (it left its
        queue for good)."""
        scheduler = self._scheduler
        if back := request_state.unfinished(waiting):
            scheduler.waiting.prepend_requests(reversed(back))
        scheduler.running[:0] = request_state.unfinished(running)
        scheduler.max_num_running_reqs += len(running)
        scheduler.max_num_active_reqs += len(running)

    # -- the step's output ---------------------------------------------------------

    def send_whole(self, output: SchedulerOutput, request_ids: set[str]) -> set[str]:
        """Sends each request of ``request_ids`` that ``output`` schedules as
        a cached request to its workers whole instead (a ``NewRequestData``
        for an id they know: upstream's streaming-input update); returns the
        ids sent. A request already among the new ones counts as sent."""
        sent = {new.req_id for new in output.scheduled_new_reqs} & request_ids
        cached = output.scheduled_cached_reqs
        picked = [i for i, rid in enumerate(cached.req_ids) if rid in request_ids]
        for i in picked:
            request = self._scheduler.requests[cached.req_ids[i]]
            new = NewRequestData.from_request(
                request,
                self.block_ids_of(request.request_id),
                list(request.all_token_ids) if self.v2 else None,
            )
            # schedule() has already advanced the request past this step.
            new.num_computed_tokens = cached.num_computed_tokens[i]
            output.scheduled_new_reqs.append(new)
            sent.add(request.request_id)
        if picked:
            _drop_rows(cached, set(picked))
        return sent

    def split_rows(
        self,
        output: SchedulerOutput,
        request: Request,
        rows: list[tuple[int, int]],
        params: SamplingParams,
    ) -> list[str]:
        """Runs the tokens ``output`` schedules for ``request`` as query rows
        over its one block table: ``rows`` are the positions ``[a, b)`` they
        compute (sorted; their lengths sum to what was scheduled). The
        request itself runs the last (it is sent whole, standing at the
        row's start); every other row is a *row request* the workers see as
        a new request, with the request's blocks and prompt up to ``b`` and
        ``a`` computed. Returns the row requests' ids: they must be ended
        (:meth:`end_rows`) in a later step's output. The scheduler never
        knows them; :func:`.requests.settle_rows` squares the request's
        in-flight count when the step's output comes back."""
        request_id = request.request_id
        self.send_whole(output, {request_id})
        new = next(n for n in output.scheduled_new_reqs if n.req_id == request_id)
        *others, (start, stop) = rows
        new.num_computed_tokens = start
        output.num_scheduled_tokens[request_id] = stop - start
        prompt = request.prompt_token_ids or []
        ids = []
        for first, end in others:
            self._num_rows += 1
            row_id = f"{request_id}#kvreuse-row-{self._num_rows}"
            tokens = prompt[:end]
            row = NewRequestData(
                req_id=row_id,
                prompt_token_ids=tokens,
                mm_features=[],
                sampling_params=params,
                pooling_params=None,
                block_ids=new.block_ids,
                num_computed_tokens=first,
                lora_request=request.lora_request,
                prefill_token_ids=tokens if self.v2 else None,
            )
            output.scheduled_new_reqs.append(row)
            output.num_scheduled_tokens[row_id] = end - first
            ids.append(row_id)
        return ids

    @staticmethod
    def end_rows(output: SchedulerOutput, row_ids: Iterable[str]) -> None:
        """The workers drop these row requests with this step."""
        output.finished_req_ids.update(row_ids)


def _drop_rows(cached: Any, rows: set[int]) -> None:
    """Removes rows from a ``CachedRequestData``: its lists are parallel, so
    each is rewritten by name (the registry pins its fields)."""
    keep = [i for i in range(len(cached.req_ids)) if i not in rows]
    gone = {cached.req_ids[i] for i in rows}
    cached.req_ids = [cached.req_ids[i] for i in keep]
    cached.new_block_ids = [cached.new_block_ids[i] for i in keep]
    cached.num_computed_tokens = [cached.num_computed_tokens[i] for i in keep]
    cached.num_output_tokens = [cached.num_output_tokens[i] for i in keep]
    if cached.new_token_ids:
        cached.new_token_ids = [cached.new_token_ids[i] for i in keep]
    cached.resumed_req_ids = cached.resumed_req_ids - gone
    for rid in gone:
        cached.all_token_ids.pop(rid, None)


# -- without a scheduler ---------------------------------------------------------


def block_ids(manager: KVCacheManager, request_id: str) -> tuple[list[int], ...]:
    """The request's block ids in each KV-cache group (a connector has the
    manager, :meth:`KVConnectorBase_V1.bind_kv_cache_manager`)."""
    return manager.get_block_ids(request_id)


def referenced_blocks(scheduler: Any) -> Iterator[Any]:
    """Every block reference upstream's own owners account for: block
    tables, queued copy endpoints, deferred frees (nulls included)."""
    manager = scheduler.kv_cache_manager
    for single in manager.coordinator.single_type_managers:
        for blocks in single.req_to_blocks.values():
            yield from blocks
        for pair in single._pending_cow_copies:
            yield from pair
    for _, blocks in scheduler.deferred_frees:
        yield from blocks
