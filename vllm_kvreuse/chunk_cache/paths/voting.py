"""Answer paths in the engine core: scoring requests, the request held, the decision.

The feature hands a chunked request in ``paths`` or ``choose`` mode to
:class:`Voting`, which spawns one scoring request per document
(:mod:`.modes`), holds the request out of each schedule until every path is
scored (the core's holds, :mod:`vllm_kvreuse.core.holds`, for the reason
:data:`REASON`), then makes the prompt of the documents kept
(:meth:`.ballot.Ballot.kept`) the request's prompt. Nothing here touches KV:
paths and the chosen prompt are ordinary prompts, cached and found by
vLLM's prefix cache (and, for paths, the chunk store: below).

Ownership: :attr:`Voting.ballots` (the only one changing them) holds each
waiting request and its scoring requests' ids; a request leaves it when
decided, when it finishes, or when a scoring request ends without a score
(it then runs jointly: :meth:`Voting.on_output`, or
:meth:`Voting.on_scoring_finish` for one the engine finished itself,
returns it to the feature).

A path's prefix (``head + document``) is found in vLLM's prefix cache while
it holds it; over a corpus it soon does not, so each scoring request is
also planned on the chunk store, *exact* (``plan_path``): a document stored
with the head as its only context is exactly that prefix and is loaded;
one stored elsewhere is computed; a new one is stored as computed here.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request, RequestStatus

from vllm_kvreuse.chunk_cache.paths.ballot import Ballot, Ballots, Choice
from vllm_kvreuse.chunk_cache.paths.modes import Layout, prefix_hasher
from vllm_kvreuse.core.internal import derived_request
from vllm_kvreuse.core.request_keys import CHUNKS, DOCUMENTS

if TYPE_CHECKING:
    from vllm.v1.engine import EngineCoreOutput

    from vllm_kvreuse.core.context import Core
    from vllm_kvreuse.core.internal import Spawner

REASON = "waiting for path scores"
"""Why a chunked request is held (``core.holds``) until it is decided."""
_NO_OUTPUT = (RequestStatus.FINISHED_ERROR, RequestStatus.FINISHED_ABORTED)
"""How the engine itself finishes an internal request: with no output."""


class Voting:
    """Chunked requests waiting for their paths' scores."""

    def __init__(
        self,
        core: Core,
        owner: Spawner,
        on_decided: Callable[[str, int], None],
        plan_path: Callable[[Request, list[int]], None],
    ) -> None:
        """``on_decided(request_id, kept)`` hears each decision;
        ``plan_path(scoring, lengths)`` plans a scoring request's prefix
        chunks (``head + document``) before it is spawned."""
        self.core = core
        self._owner = owner
        self._on_decided = on_decided
        self._plan_path = plan_path
        self.ballots = Ballots()
        self._counter = itertools.count()
        self.num_decided = 0

    def start(self, request: Request, layout: Layout, choice: Choice) -> None:
        """Spawns ``request``'s scoring requests; it waits for their scores."""
        upstream = self.core.upstream
        hasher = upstream.hasher_of(request)
        number = next(self._counter)
        ballot = Ballot(request, layout, choice)
        for index in range(len(layout.documents)):
            scoring_id = f"kvreuse-path-{number}-{index}-{request.request_id}"
            ballot.paths[scoring_id] = layout.path(index)
        self.ballots.open(ballot)
        self.core.holds.hold(request, REASON)
        for scoring_id, path in ballot.paths.items():
            # The question's log-probs, from rows the prefix cache cannot
            # hold (past the document, blocks hash at random).
            params = SamplingParams(
                max_tokens=1,
                temperature=0.0,
                prompt_logprobs=0,
                skip_reading_prefix_cache=False,
                detokenize=False,
            )
            hashes = prefix_hasher(hasher, upstream.hash_block_size, path.prefix)
            scoring_request = derived_request(
                request, scoring_id, path.tokens, params, hashes
            )
            self._plan_path(scoring_request, path.lengths[: len(layout.head) + 1])
            self.core.internal.spawn(scoring_request, self._owner)

    def on_output(self, output: EngineCoreOutput) -> Request | None:
        """A scoring request's output. Decides its request once every path
        is scored; returns the request if a path ended unscored (it then
        runs jointly)."""
        ballot = self.ballots.ballot_of(output.request_id)
        if ballot is None:
            return None
        logprobs = output.new_prompt_logprobs_tensors
        if logprobs is not None:
            decided = self.ballots.score(output.request_id, logprobs)
            if decided is not None:
                self._decide(decided)
            return None
        if output.finish_reason is None:
            return None
        self.forget(ballot.request.request_id)  # ended without its score
        return ballot.request

    def on_scoring_finish(self, scoring: Request) -> Request | None:
        """A scoring request is freed. One the engine finished itself (a
        failure, an abort) sends no output to :meth:`on_output`: its request
        gives up its paths and is returned (it then runs jointly), or it
        would wait for that score for ever."""
        ballot = self.ballots.ballot_of(scoring.request_id)
        if ballot is None or scoring.status not in _NO_OUTPUT:
            return None
        self.forget(ballot.request.request_id)
        return ballot.request

    def forget(self, request_id: str) -> None:
        """``request_id`` finished, or gave up its paths: its scoring
        requests still running are aborted, and it is held no more."""
        self.core.abort(self.ballots.close(request_id))
        self.core.holds.unhold(request_id, REASON)

    def _decide(self, ballot: Ballot) -> None:
        request = ballot.request
        self.ballots.close(request.request_id)
        self.core.holds.unhold(request.request_id, REASON)
        kept = ballot.kept()
        tokens, lengths = ballot.layout.prompt(kept)
        # From here the request is the chunked request of its kept documents
        # (a continuation of it reads these lengths); its own copy of the
        # params, as n > 1 siblings may share one.
        params = copy.copy(request.sampling_params)
        extra_args = {
            k: v for k, v in (params.extra_args or {}).items() if k != DOCUMENTS
        }
        params.extra_args = {**extra_args, CHUNKS: lengths}
        # Waiting, never scheduled: no block, nothing computed.
        self.core.upstream.retoken(request, tokens, 0, [], params)
        self.num_decided += 1
        self._on_decided(request.request_id, len(kept))
