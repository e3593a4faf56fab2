"""Requests waiting for their paths' scores (:mod:`.modes`), and the decision."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.v1.request import Request

from vllm_kvreuse.chunk_cache.paths.modes import (
    Layout,
    Path,
    kept_documents,
    question_score,
)


@dataclass(frozen=True, slots=True)
class Choice:
    """How a ballot is decided: ``paths`` keeps one document, ``choose`` up to
    ``k`` within ``margin`` (mean log-prob per scored token) of the best."""

    mode: str
    margin: float = 0.0
    k: int = 1


@dataclass(slots=True)
class Ballot:
    """A chunked request's paths, by scoring request id, until all scored."""

    request: Request
    layout: Layout
    choice: Choice
    paths: dict[str, Path] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return all(path.score is not None for path in self.paths.values())

    def winner(self) -> Path:
        """The likeliest path (ties: the earlier document)."""
        scored = list(self.paths.values())
        return max(scored, key=lambda p: (p.score, -p.document))

    def kept(self) -> list[int]:
        """The documents the request is answered on, in the client's order."""
        if self.choice.mode != "choose":
            return [self.winner().document]
        paths = list(self.paths.values())
        return kept_documents(paths, self.choice.margin, self.choice.k)


class Ballots:
    """Requests waiting for their paths' scores, and their scoring requests.

    Owner of both maps: a ballot is opened by :meth:`open`, scored by
    :meth:`score`, and closed by :meth:`close` (decided or given up).
    """

    def __init__(self) -> None:
        self.by_request: dict[str, Ballot] = {}
        self._of_scoring: dict[str, str] = {}  # scoring id -> request id

    def open(self, ballot: Ballot) -> None:
        self.by_request[ballot.request.request_id] = ballot
        for scoring_id in ballot.paths:
            self._of_scoring[scoring_id] = ballot.request.request_id

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
