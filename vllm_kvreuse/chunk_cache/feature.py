"""The chunk cache as a scheduler feature: chunked requests' plans.

A chunked request arrives with ``extra_args["kvreuse_chunks"]``, the token
lengths of its chunks (every segment but the question). On arrival the
scheduler side plans it (:mod:`.engine.planner`): chunks stored are loaded
(re-rotated), chunks not stored are computed in place and stored from the
request's blocks. Then:

1. if it loads a chunk computed elsewhere, its blocks are re-hashed under
   a salt naming their values (:class:`~.engine.keys.Provenance`), so they never
   match a request holding other values; a request that loads only what
   full attention computes keeps its own salt;
2. its prefill is *segmented* where loads and computed spans alternate.
   Where seats and the token budget allow, the whole of it runs in one
   step (:mod:`.engine.rows`): every region loaded, every computed span a
   query row of the step over the request's block table. Otherwise each
   step loads one region and computes the span after it
   (:meth:`cap_new_tokens` ends the step there), and between steps
   :meth:`before_schedule` moves the request past the next region, which
   the connector loads in that same step. Either way each span is a
   prefill of vLLM's own, with exact causality, on every backend and both
   runners; the moved request is sent to its workers whole
   (``core.resends.resend``: both runners take a known request's new state
   from ``scheduled_new_reqs``);
3. a preempted request is planned again from scratch when it is preempted
   (it holds no block then, so its salt may change).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.v1.request import Request, RequestStatus

from vllm_kvreuse.chunk_cache.connector import find_chunk_connector
from vllm_kvreuse.chunk_cache.engine.recompute import REQUEST_KEY, Recompute
from vllm_kvreuse.chunk_cache.engine.rows import StepRows
from vllm_kvreuse.chunk_cache.params import chunk_lengths
from vllm_kvreuse.chunk_cache.paths import modes
from vllm_kvreuse.chunk_cache.paths.ballot import Choice
from vllm_kvreuse.chunk_cache.paths.voting import Voting
from vllm_kvreuse.core.feature import Feature
from vllm_kvreuse.core.request_keys import BEAM, DOCUMENTS, PARENT

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.outputs import ModelRunnerOutput

    from vllm_kvreuse.chunk_cache.engine.planner import ChunkScheduler
    from vllm_kvreuse.core.context import Core


class ChunkCache(Feature):
    """Turns chunked requests into chunk loads and chunks computed in place."""

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
        self.rows = StepRows(core.upstream)
        self.side.arming.seats = self.rows
        # New segmented requests: upstream counts only their first load
        # region as cached at first schedule; after_schedule counts the rest.
        self._uncounted: set[str] = set()
        settings = core.config
        self.attention: str = settings.chunk_attention
        self._choose = Choice(
            "choose", settings.chunk_choose_margin, settings.chunk_choose_k
        )
        self.max_documents: int = settings.chunk_paths_max_documents  # 0: no cap
        self.voting = Voting(core, self, self._decided, self._plan_path)

    # -- requests --------------------------------------------------------------

    def on_add(self, request: Request) -> None:
        lengths = chunk_lengths(request, request.num_prompt_tokens)
        if lengths is None:
            return
        self.side.said.steps[request.request_id] = 0
        attention = _attention_of(request, self.attention)
        if attention != "joint" and _may_take_paths(request):
            extra_args = request.sampling_params.extra_args or {}
            prompt = request.prompt_token_ids or []
            layout = modes.layout_of(prompt, lengths, extra_args.get(DOCUMENTS))
            if layout is None:
                return  # one document, nothing to choose: an ordinary prompt
            if not self.max_documents or len(layout.documents) <= self.max_documents:
                choice = self._choose if attention == "choose" else Choice("paths")
                self.voting.start(request, layout, choice)
                return
            # One scoring request a document: past the cap, joint, said so.
            self.side.said.capped(request.request_id, self.max_documents)
        self._plan(request, lengths)

    def on_preempt(self, request: Request) -> None:
        """A preempted chunked request is planned again: what it saved is
        stored now, and what it loaded may be gone."""
        plan = self.side.release(request.request_id)
        if plan is not None:
            self.core.upstream.rehash(request, plan.user_salt)
            self._plan(request)

    def on_finish(self, request: Request) -> None:
        self._uncounted.discard(request.request_id)
        if request.request_id in self.voting.ballots.by_request:
            self.voting.forget(request.request_id)
        elif (given_up := self.voting.on_scoring_finish(request)) is not None:
            self._plan(given_up)

    def on_internal_output(self, output: EngineCoreOutput) -> None:
        """A path's score; a request whose path ended unscored runs jointly."""
        request = self.voting.on_output(output)
        if request is not None:
            self._plan(request)

    def extra_hit_tokens(self, request: Request, num_local: int) -> int | None:
        """Stored chunks past the local hit count as hits (threshold check)."""
        return self.side.stored_tokens_past(request.request_id, num_local)

    def cap_new_tokens(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        """A one-pass step runs whole or not at all; else a segmented
        request's step ends where its recomputed span does."""
        return self.side.cap(request, num_computed_tokens, num_new_tokens)

    # -- steps -----------------------------------------------------------------

    def before_schedule(self) -> None:
        self.rows.give_back()  # a schedule() that raised kept them
        for request_id in self.side.take_rolled_back():
            self.core.resends.resend(request_id)  # recomputes a failed load
        self._advance_segments()

    def after_schedule(self, output: SchedulerOutput) -> None:
        """Armed one-pass requests scheduled whole run as rows; the others
        stand where they did. Then the steps to first token are counted."""
        self.rows.give_back()
        armed = self.side.arming.take()
        if armed or self.rows.has_work:
            requests = self.core.scheduler.requests
            for request_id in self.rows.split(output, armed):
                if (request := requests.get(request_id)) is not None:
                    self.side.disarm(request, armed[request_id])
        if self.side.said.steps:
            self.side.said.count_steps(output, self.core.scheduler.requests)
        if self._uncounted:
            self._count_cached()

    def on_model_output(
        self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput
    ) -> None:
        self.rows.settle(scheduler_output)

    def _count_cached(self) -> None:
        """At a new chunked request's first schedule, its prefill stats (and
        so ``cached_tokens``) count every token it will load from the store
        and that was stored when it arrived, whatever step loads it."""
        requests = self.core.scheduler.requests
        for request_id in list(self._uncounted):
            request = requests.get(request_id)
            stats = request.prefill_stats if request is not None else None
            plan = self.side.plans.get(request_id)
            if stats is None or plan is None:
                self._uncounted.discard(request_id)
            elif stats.num_prompt_tokens:  # upstream set them at first schedule
                self._uncounted.discard(request_id)
                local = stats.num_local_cached_tokens
                stats.set(
                    num_prompt_tokens=stats.num_prompt_tokens,
                    num_local_cached_tokens=local,
                    num_external_cached_tokens=plan.num_loaded(begin=local),
                )

    def waiting_summary(self) -> dict[str, int]:
        side = self.side
        return {
            "chunked_requests": len(side.plans),
            "pinned_chunks": side.store.index.num_pinned,
            "waiting_for_path_scores": len(self.voting.ballots.by_request),
        }

    def admin(self, action: str, **chunk: Any) -> dict[str, Any]:
        """The admin endpoint's actions on this store
        (:meth:`.engine.store.ChunkStore.admin`)."""
        return self.side.store.admin(action, **chunk)

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

    def _plan_path(self, scoring: Request, lengths: list[int]) -> None:
        """A scoring request's ``head + document`` loads from the store
        where it is stored exact, and is stored where it is new."""
        self.side.plan(scoring, lengths, Recompute(), exact=True)

    def _decided(self, request_id: str, kept: int) -> None:
        """A decided request (its prompt now the kept documents') loads
        what the store holds exact (its head and first kept document, as
        its path stored them) and computes the rest: full attention."""
        self.side.said.decided(request_id, kept)
        request = self.core.scheduler.requests.get(request_id)
        lengths = chunk_lengths(request, request.num_prompt_tokens) if request else None
        if request is not None and lengths is not None:
            self.side.plan(request, lengths, Recompute(), exact=True)

    def _plan(self, request: Request, lengths: list[int] | None = None) -> None:
        """Plans a chunked request (it holds no block now) and re-hashes its
        blocks under the salt naming their values."""
        lengths = lengths or chunk_lengths(request, request.num_prompt_tokens)
        if lengths is None:
            return
        plan = self.side.plan(request, lengths, _recompute_of(request))
        if plan is None:
            return
        if plan.block_salt != request.cache_salt:
            self.core.upstream.rehash(request, plan.block_salt)
        if plan.spans and plan.loaded_keys:
            self._uncounted.add(request.request_id)


def _attention_of(request: Request, default: str) -> str:
    """The request's own attention mode, else the server's (parsed in the
    frontend: read as it is)."""
    extra_args = request.sampling_params.extra_args or {}
    value = extra_args.get(modes.REQUEST_KEY)
    return default if value is None else value


def _may_take_paths(request: Request) -> bool:
    """Paths change the prompt the engine runs: not for a request whose
    client reads prompt log-probs (they would be the path's), nor for a
    continuation (it inherits blocks of its parent's prompt) or a beam
    search (its members fork the prompt it arrived with)."""
    params = request.sampling_params
    extra_args = params.extra_args or {}
    claimed = PARENT in extra_args or BEAM in extra_args
    return params.prompt_logprobs is None and not claimed


def _recompute_of(request: Request) -> Recompute | None:
    """The request's own recompute settings; None: the server's (parsed in
    the frontend: carried whole)."""
    extra_args = request.sampling_params.extra_args or {}
    value = extra_args.get(REQUEST_KEY)
    return None if value is None else Recompute(**value)
