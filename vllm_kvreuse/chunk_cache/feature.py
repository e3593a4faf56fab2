"""The chunk cache as a scheduler feature: chunked requests and their fills.

A chunked request arrives with ``extra_args["kvreuse_chunks"]``, the token
lengths of its chunks (every segment but the question). On arrival:

1. the scheduler side keys each chunk, pins the chunks stored or being
   filled, and reserves room for the others (:mod:`.scheduler_side`);
2. one *fill* per missing chunk is spawned as an internal request: a
   one-token request whose prompt is the chunk alone (after the system
   prompt in "system" mode), so its KV is chunk-isolated at virtual
   positions without any attention mask; its KV is saved in the step that
   finishes its prefill;
3. the request's blocks are re-hashed under a salt of its own
   (:func:`~.keys.chunked_salt`), so blocks holding chunk KV never match an
   ordinary request;
4. vLLM then loads every chunk into the request's blocks (re-rotated) and
   prefills only the question, once every chunk is stored.
5. With recomputed spans (:mod:`.recompute`: chunk heads, chunks chosen by
   the question, a tail) the prefill is *segmented*: each step loads one
   region and computes the span after it (:meth:`cap_new_tokens` ends the
   step there), and between steps :meth:`before_schedule` moves the request
   past the next region, which the connector loads in that same step. Each
   span is a contiguous prefill of vLLM's own, with exact causality, on
   every backend and both runners; the moved request is sent to its workers
   whole (``core.resends.resend``: both runners take a known request's new
   state from ``scheduled_new_reqs``).

If room cannot be reserved (a chunk larger than the store, or a store full
of pinned chunks), the request runs as an ordinary request: never an error.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request, RequestStatus

from vllm_kvreuse.chunk_cache import store_admin
from vllm_kvreuse.chunk_cache.connector import find_chunk_connector
from vllm_kvreuse.chunk_cache.params import chunk_lengths
from vllm_kvreuse.chunk_cache.plan import FillSpec
from vllm_kvreuse.chunk_cache.recompute import (
    REQUEST_KEY,
    Recompute,
    parse_recompute,
)
from vllm_kvreuse.core.feature import Feature

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

    from vllm_kvreuse.chunk_cache.scheduler_side import ChunkScheduler
    from vllm_kvreuse.core.context import Core

logger = init_logger(__name__)


class ChunkCache(Feature):
    """Turns chunked requests into chunk loads plus fills of missing chunks."""

    name = "chunk_cache"

    def __init__(self, core: Core) -> None:
        super().__init__(core)
        connector = find_chunk_connector(core.scheduler.connector)
        if connector is None:
            configured = core.scheduler.connector
            raise ValueError(
                "--enable-chunk-cache needs the chunk-cache connector, alone or "
                "in a MultiConnector; this engine has "
                f"{type(configured).__name__ if configured else 'none'}"
            )
        assert connector.scheduler_side is not None
        self.side: ChunkScheduler = connector.scheduler_side
        self._fill_counter = itertools.count()
        # Tokens of each new chunked request not stored when it arrived: its
        # prefill stats must not count them as cached, although they are
        # loaded like stored ones. Segmented requests are here too: upstream
        # counts only their first load region at first schedule.
        self._uncached: dict[str, int] = {}
        self._replan: set[str] = set()

    # -- requests --------------------------------------------------------------

    def on_add(self, request: Request) -> None:
        lengths = chunk_lengths(request, request.num_prompt_tokens)
        if lengths is None:
            return
        planned = self.side.plan(request, lengths, _recompute_of(request))
        if planned is None:
            logger.info(
                "chunk cache full or chunk too large: request %s runs as an "
                "ordinary request",
                request.request_id,
            )
            return
        plan, fills, uncached = planned
        self._start_fills(request, fills)
        self.core.upstream.rehash(request, self.side.block_salt(plan, lengths))
        if uncached or plan.spans:
            self._uncached[request.request_id] = uncached

    def on_preempt(self, request: Request) -> None:
        """A preempted chunked request loads its chunks again when resumed."""
        self.side.forget_load(request.request_id)
        self._plan_again(request)

    def on_finish(self, request: Request) -> None:
        if request.request_id in self.side.fills:
            self._replan.update(self.side.fill_finished(request.request_id))
        self._uncached.pop(request.request_id, None)

    def extra_hit_tokens(self, request: Request, num_local: int) -> int | None:
        """Stored chunks past the local hit count as hits (threshold check)."""
        return self.side.stored_tokens_past(request.request_id, num_local)

    def cap_new_tokens(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        """A segmented request's step ends where its recomputed span does."""
        stop = self.side.compute_stop(request.request_id, num_computed_tokens)
        return num_new_tokens if stop is None else stop - num_computed_tokens

    # -- steps -----------------------------------------------------------------

    def before_schedule(self) -> None:
        self._advance_segments()
        if not self._replan:
            return
        replan, self._replan = self._replan, set()
        requests = self.core.scheduler.requests
        for request_id in replan:
            request = requests.get(request_id)
            if request is not None and not request.num_computed_tokens:
                self._plan_again(request)

    def after_schedule(self, output: SchedulerOutput) -> None:
        """At a new chunked request's first schedule, its prefill stats (and
        so ``cached_tokens``) count every token it will load from the store
        and that was stored when it arrived, whatever step loads it."""
        if not self._uncached:
            return
        requests = self.core.scheduler.requests
        for request_id in list(self._uncached):
            request = requests.get(request_id)
            stats = request.prefill_stats if request is not None else None
            plan = self.side.plans.get(request_id)
            if stats is None or plan is None:
                self._uncached.pop(request_id)
            elif stats.num_prompt_tokens:  # upstream set them at first schedule
                uncached = self._uncached.pop(request_id)
                local = stats.num_local_cached_tokens
                stats.set(
                    num_prompt_tokens=stats.num_prompt_tokens,
                    num_local_cached_tokens=local,
                    num_external_cached_tokens=max(
                        0, plan.num_loaded(begin=local) - uncached
                    ),
                )

    def waiting_summary(self) -> dict[str, int]:
        side = self.side
        return {
            "chunked_requests": len(side.plans),
            "waiting_for_fills": side.num_waiting(),
            "fills": len(side.fills),
            "pinned_chunks": side.index.num_pinned,
        }

    def admin(self, action: str, **chunk: Any) -> dict[str, Any]:
        """The admin endpoint's actions on this store (:func:`.store_admin.run`)."""
        return store_admin.run(self.side, action, **chunk)

    # -- helpers ---------------------------------------------------------------

    def _advance_segments(self) -> None:
        """Moves each running segmented request past the load region it has
        reached; the region is loaded in the step that next schedules it."""
        requests = self.core.scheduler.requests
        for request_id, plan in self.side.plans.items():
            if not plan.spans:
                continue
            request = requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            if self.side.advance(request):
                self.core.resends.resend(request_id)

    def _plan_again(self, request: Request) -> None:
        """Re-pins ``request``'s chunks and re-fills the missing ones; with no
        room, it runs on as an ordinary request (it holds no blocks now, so
        its hashes can change)."""
        plan = self.side.plans.get(request.request_id)
        if plan is None:
            return
        fills = self.side.repin(request)
        if fills is None:
            self.core.upstream.rehash(request, plan.user_salt)
            return
        self._start_fills(request, fills)

    def _start_fills(self, request: Request, fills: list[FillSpec]) -> None:
        plan = self.side.plans.get(request.request_id)
        salt = plan.user_salt if plan is not None else request.cache_salt
        for fill in fills:
            fill_request = Request(
                request_id=f"kvreuse-fill-{next(self._fill_counter)}-"
                f"{fill.key.hex()[:12]}",
                prompt_token_ids=fill.prompt,
                sampling_params=SamplingParams(max_tokens=1, temperature=0.0),
                pooling_params=None,
                client_index=request.client_index,
                lora_request=request.lora_request,
                # The fill's KV is ordinary KV of its prompt.
                cache_salt=salt,
                priority=request.priority,
                block_hasher=self.core.upstream.hasher_of(request),
            )
            self.side.add_fill(fill_request, fill)
            self.core.internal.spawn(fill_request, self)


def _recompute_of(request: Request) -> Recompute | None:
    """The request's own recompute settings; None: the server's."""
    extra_args = request.sampling_params.extra_args or {}
    value = extra_args.get(REQUEST_KEY)
    return None if value is None else parse_recompute(value)
