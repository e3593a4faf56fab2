"""Per-document answer paths (``--chunk-attention paths``).

A chunked request ``[system, doc_1 .. doc_N, question]`` is answered on one
*path*, ``system + doc_k + question``: the path whose document makes the
question likeliest (superposition prompting's saliency, arXiv 2404.06910,
pruned to one path; PCED, arXiv 2601.08670, combines the paths instead).
Each path is an ordinary prompt, so vLLM's prefix cache keeps ``system +
doc_i`` exactly as full attention computes it, at the same positions, in
whatever company a later request retrieves ``doc_i``: nothing is moved or
approximated, and no document's facts can leak into another's answer. The
price: an answer comes from one document (a question that needs two gets
the likeliest one's answer).

How, in the engine core (:class:`Ballots`, driven by the feature):

1. On arrival, one *scoring* request per document, internal, one token:
   its prompt is the path, with prompt log-probs. It reads the prefix cache
   for ``system + doc_i``, but its blocks past the document hash at random,
   so the question's rows are always computed, never found cached.
2. The chunked request waits out of the queue (held out of each schedule)
   until every score is in; then its prompt becomes the winning path and it
   runs as an ordinary request, its prefix found in the cache the winning
   scoring request just filled.
3. A path's score is the log-likelihood of the question's tokens after its
   first (whose row may fall in the cached prefix), so all paths sum the
   same tokens. Ties go to the earlier document.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.request import Request

MODES = ("joint", "paths")
"""``--chunk-attention``: ``joint`` (one prompt, chunks loaded or computed in
place) or ``paths`` (this module)."""
REQUEST_KEY = "chunk_attention"
"""Public request field: this request's attention mode (else the server's)."""


def parse_attention(value: Any) -> str:
    """A ``chunk_attention`` field, or ``ValueError``."""
    if value not in MODES:
        raise ValueError(f"{REQUEST_KEY} must be one of {', '.join(MODES)}")
    return value


@dataclass(slots=True)
class Path:
    """``system + document + question``: ``system`` and ``prefix`` (system
    prompt + document) are token counts."""

    tokens: list[int]
    system: int
    prefix: int
    score: float | None = None

    @property
    def lengths(self) -> list[int]:
        """The path's chunk lengths: the system prompt, the document."""
        return [self.system, self.prefix - self.system]


def paths_of(prompt: list[int], lengths: list[int]) -> list[Path]:
    """One path per document of a chunked prompt (every chunk after the
    first, the system prompt); none with fewer than two documents."""
    if len(lengths) < 3:
        return []
    system, end = lengths[0], sum(lengths)
    question = prompt[end:]
    paths, start = [], system
    for length in lengths[1:]:
        tokens = [*prompt[:system], *prompt[start : start + length], *question]
        paths.append(Path(tokens, system, system + length))
        start += length
    return paths


def question_score(logprobs: Any, num_tokens: int, prefix: int) -> float:
    """Sum of the log-probs of a path's question tokens after its first.

    ``logprobs``: the prompt log-probs vLLM returned (``LogprobsTensors``:
    column 0 the prompt token's own), one row per prompt position computed,
    row ``r`` scoring token ``r + 1``. The V1 runner returns every row of the
    prompt (rows of a cached prefix unset), the V2 runner the computed rows
    only; both end at row ``num_tokens - 2``.
    """
    rows = logprobs.logprobs[:, 0]
    first_row = num_tokens - 1 - rows.shape[0]
    return float(rows[prefix - first_row : num_tokens - 1 - first_row].sum())


def prefix_hasher(
    hasher: Callable[[Request], list[Any]], block_size: int, prefix: int
) -> Callable[[Request], list[Any]]:
    """``hasher`` whose hashes past the last full block of ``prefix`` tokens
    are random: a scoring request finds at most its path's prefix cached,
    and no request ever finds one of its question's blocks (vLLM caches
    every full block a request computes, so each needs a hash)."""
    num_blocks = prefix // block_size

    def hash_prefix(request: Request) -> list[Any]:
        start = len(request.block_hashes)
        return [
            block_hash if start + i < num_blocks else _unmatched(block_hash)
            for i, block_hash in enumerate(hasher(request))
        ]

    return hash_prefix


def _unmatched(block_hash: bytes) -> bytes:
    return secrets.token_bytes(len(block_hash))


@dataclass(slots=True)
class Ballot:
    """A chunked request's paths, by scoring request id, until all scored."""

    request: Request
    paths: dict[str, Path] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return all(path.score is not None for path in self.paths.values())

    def winner(self) -> Path:
        """The likeliest path (ties: the earlier document)."""
        scored = list(self.paths.values())
        return max(scored, key=lambda p: (p.score, -scored.index(p)))


class Ballots:
    """Requests waiting for their paths' scores, and their scoring requests.

    Owner of both maps: a ballot is opened by :meth:`open`, scored by
    :meth:`score`, and closed by :meth:`close` (decided or given up).
    """

    def __init__(self) -> None:
        self.by_request: dict[str, Ballot] = {}
        self._of_scoring: dict[str, str] = {}  # scoring id -> request id

    def open(self, request: Request, paths: dict[str, Path]) -> None:
        self.by_request[request.request_id] = Ballot(request, paths)
        for scoring_id in paths:
            self._of_scoring[scoring_id] = request.request_id

    def ballot_of(self, scoring_id: str) -> Ballot | None:
        request_id = self._of_scoring.get(scoring_id)
        return None if request_id is None else self.by_request.get(request_id)

    def score(self, scoring_id: str, logprobs: Any) -> Ballot | None:
        """Records a scoring request's prompt log-probs; returns its ballot
        once every path is scored."""
        ballot = self.ballot_of(scoring_id)
        if ballot is None:
            return None
        path = ballot.paths[scoring_id]
        path.score = question_score(logprobs, len(path.tokens), path.prefix)
        return ballot if ballot.done else None

    def close(self, request_id: str) -> list[str]:
        """Forgets ``request_id``'s ballot; returns its scoring requests."""
        ballot = self.by_request.pop(request_id, None)
        if ballot is None:
            return []
        for scoring_id in ballot.paths:
            self._of_scoring.pop(scoring_id, None)
        return list(ballot.paths)
