"""The one seam between the plugin and vLLM's internal state.

Every read and write of upstream scheduler, KV-cache-manager, request and
scheduler-output state that the features and services need, beyond what a
public upstream method does for them, is made here: the block tables and
their copy-on-write queue, the running and waiting queues and the seat
limits, a request's private token lists and its block hashes, the step
output's parallel lists; and, outside the scheduler, the one private
serving method a renderer needs (a request's LoRA adapter) and the KV
packing vLLM's CPU attention chose (the device layer reads its caches in
it). The services (:mod:`.resend`,
:mod:`.ledger`) and the features call these methods; they decide, this
module applies.

Each upstream attribute touched here is registered per vLLM release in
:data:`vllm_kvreuse.patches.upstream_state.UPSTREAM_STATE` (owner class,
why, and the method's signature or the attribute's presence);
``tests/unit/test_upstream_state.py`` checks every entry on real upstream
objects, ``tests/unit/test_private_access.py`` that no other module
reaches into them (an entry may name a registered patch's own module
instead) and that the package touches no unregistered private attribute.

Invariants (ownership, as upstream keeps it):
- A block table change moves references, never counts them by hand: a
  table entry is one reference, a queued copy's two endpoints one each
  until upstream's next ``schedule()`` drains the queue.
- Queue edits (:meth:`Upstream.hold`, :meth:`Upstream.park`) are undone by
  their pair (:meth:`Upstream.put_back`, :meth:`Upstream.unpark`) around a
  single ``schedule()``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.request import Request

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler


class Upstream:
    """One scheduler's internal state, read and changed through named steps."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._manager = scheduler.kv_cache_manager
        self._managers = self._manager.coordinator.single_type_managers
        self._pool = self._manager.block_pool
        self.block_size = scheduler.block_size
        self.hash_block_size = (
            scheduler.cache_config.hash_block_size or scheduler.block_size
        )
        self.v2 = scheduler.use_v2_model_runner

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

    # -- requests ------------------------------------------------------------------

    @staticmethod
    def retoken(
        request: Request,
        tokens: list[int],
        num_computed: int,
        block_hashes: list[Any],
        sampling_params: SamplingParams | None,
    ) -> None:
        """Makes ``tokens`` the request's whole history and prompt, the first
        ``num_computed`` of them computed, as a streaming update leaves it."""
        request.prompt_token_ids = tokens.copy()
        request.num_prompt_tokens = len(tokens)
        request._all_token_ids[:] = tokens
        request._output_token_ids.clear()
        request.num_computed_tokens = num_computed
        request.spec_token_ids = []
        request.block_hashes = list(block_hashes)
        request.update_block_hashes()
        if sampling_params is not None:
            request.sampling_params = sampling_params

    @staticmethod
    def rehash(request: Request, cache_salt: str | None) -> None:
        """Hashes the request's blocks anew under ``cache_salt`` (call while
        it holds no blocks: they would keep the old hashes)."""
        request.cache_salt = cache_salt
        request.block_hashes = []
        request.update_block_hashes()

    @staticmethod
    def hasher_of(request: Request) -> Callable[[Request], list[Any]]:
        """The request's block hasher (the engine's), to build another
        request hashed the same way."""
        return request._block_hasher

    @staticmethod
    def move_computed(request: Request, num_computed: int) -> None:
        """Sets the request's computed count (a KV connector loads the
        tokens it skips; the request is then sent whole, :mod:`.resend`)."""
        request.num_computed_tokens = num_computed

    @staticmethod
    def history(request: Request, start: int) -> list[int]:
        """A copy of the request's tokens from ``start`` on."""
        return request._all_token_ids[start:]

    @staticmethod
    def adopt(
        request: Request,
        start: int,
        length: int,
        history: list[int] | None,
        token: int,
    ) -> None:
        """Makes the request's tokens ``start .. length`` ``history`` (another
        request's; None: its own stay), and the token at ``length``
        ``token``: the sample the step appended, appended here if upstream
        dropped it (a preempted request's output in flight, dropped by a
        cache reset). Prompt and output lists are rewritten where each
        holds those positions; computed counts, blocks and hashes stay (the
        workers copied the KV; blocks past ``start`` hash privately)."""
        tokens = request._all_token_ids
        assert len(tokens) >= length, "a step's token count went back"
        num_prompt = request.num_prompt_tokens
        if history is not None:
            assert len(history) == length - start, "histories of two lengths"
            tokens[start:length] = history
            prompt = request.prompt_token_ids
            if prompt is not None and num_prompt > start:
                prompt[start:num_prompt] = history[: num_prompt - start]
            first = max(num_prompt, start)
            request._output_token_ids[first - num_prompt : length - num_prompt] = (
                history[first - start :]
            )
        if len(tokens) == length:
            request.append_output_token_ids(token)
        elif tokens[length] != token:
            tokens[length] = token
            request._output_token_ids[length - num_prompt] = token

    def unsample(self, request: Request) -> None:
        """Takes back the request's last sampled token and the hash of a
        block it completed: it will compute that position again."""
        request._all_token_ids.pop()
        if request._output_token_ids:
            request._output_token_ids.pop()
        del request.block_hashes[request.num_tokens // self.hash_block_size :]

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

    def hold(self, held: Collection[Request]) -> None:
        """Takes ``held`` (running) out of the running queue, seats and all,
        for one ``schedule()``; :meth:`put_back` undoes it."""
        if not held:
            return
        scheduler = self._scheduler
        gone = set(map(id, held))
        scheduler.running[:] = [r for r in scheduler.running if id(r) not in gone]
        scheduler.max_num_running_reqs -= len(held)
        scheduler.max_num_active_reqs -= len(held)

    def put_back(self, held: list[Request]) -> None:
        """Returns held requests, and their seats, to the head of the running
        queue: they have already run this step, so they are the last to be
        preempted."""
        scheduler = self._scheduler
        scheduler.running[:0] = held
        scheduler.max_num_running_reqs += len(held)
        scheduler.max_num_active_reqs += len(held)

    def preempt(self, requests: list[Request]) -> None:
        """Preempts running ``requests`` as upstream does (out of the running
        queue, blocks freed, back to waiting). Only for requests this step
        did not schedule."""
        scheduler = self._scheduler
        scheduler.running[:] = [r for r in scheduler.running if r not in requests]
        now = time.monotonic()
        for request in requests:
            scheduler._preempt_request(request, now)

    def park(self, requests: list[Request]) -> list[Request]:
        """Takes those of ``requests`` that are in the waiting queue out of it
        for one ``schedule()``; returns them (the ones to :meth:`unpark`)."""
        waiting = self._scheduler.waiting
        present = [request for request in requests if request in waiting]
        if present:
            waiting.remove_requests(present)
        return present

    def unpark(self, requests: list[Request]) -> None:
        """Puts parked requests back at the head of the queue, in their order;
        one finished meanwhile stays out (it left the queue for good)."""
        back = [request for request in requests if not request.is_finished()]
        if back:
            self._scheduler.waiting.prepend_requests(reversed(back))

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


def cpu_attn_isa(dtype: Any, block_size: int, head_size: int, kv_dtype: str) -> str:
    """The packing vLLM's CPU attention chose for a layer's KV cache (it
    imports CPU-only code: call on CPU)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_size, kv_dtype)


def lora_request_of(serving: Any, request: Any) -> Any:
    """The LoRA adapter an OpenAI serving object runs ``request`` with (None:
    the base model); raises vLLM's not-found error for an unknown model."""
    return serving._maybe_get_adapters(request)


def never_stop(sampling: SamplingParams) -> None:
    """Clears every stop condition of ``sampling`` (a live beam member stops
    only when its group aborts it), the derived EOS sets included."""
    sampling.min_tokens = 0
    sampling.stop_token_ids = None
    sampling._eos_token_id = None
    sampling._all_stop_token_ids = set()


def share_block_hashes(
    request: Request,
    root: Request,
    num_hashes: int,
    private_block_size: int | None = None,
) -> None:
    """Gives ``request`` ``root``'s first ``num_hashes`` block hashes and
    hasher, then hashes its blocks past them (hashes chain, so the hasher
    continues from the last one). With ``private_block_size`` (the hash
    block size) every later block gets a random hash instead, which no
    request's lookup can match: its content may change while it is cached."""
    request.block_hashes = root.block_hashes[:num_hashes]
    if private_block_size is None:
        request._block_hasher = root._block_hasher
    else:
        request._block_hasher = _private_hasher(private_block_size)
    request.update_block_hashes()


def _private_hasher(hash_block_size: int) -> Callable[[Request], list[Any]]:
    def hasher(request: Request) -> list[Any]:
        """Random hashes for the request's full blocks that have none yet."""
        blocks = request.num_tokens // hash_block_size
        return [os.urandom(32) for _ in range(blocks - len(request.block_hashes))]

    return hasher


def api_process_count(parallel_config: Any) -> int:
    """API-server processes in front of this engine (1 unless
    ``--api-server-count`` or data parallelism started more)."""
    return parallel_config._api_process_count


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
