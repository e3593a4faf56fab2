"""Answer paths (``--chunk-attention paths``) and choose-then-combine
(``choose``): what a path is, and how it is scored.

A chunked request ``[head, doc_1 .. doc_N, tail, question]`` has one *path*
per document, ``head + doc_k + tail + question``: the *head* is the system
prompt (the first chunk, or whatever the frontend says comes before the
documents), the *tail* the conversation turns after them (none for a
``chunks`` request). Only documents are candidates: a conversation's turns
stand in every path (:data:`DOCUMENTS`).

Each path is an ordinary prompt, so vLLM's prefix cache keeps ``head +
doc_k`` exactly as full attention computes it, at the same positions, in
whatever company a later request retrieves ``doc_k``: nothing is moved or
approximated. A path's score is the log-likelihood of the tokens after its
document (tail and question), after the first (whose row may fall in the
cached prefix), so all paths sum the same tokens; per token, it does not
grow with the question's length (superposition prompting's saliency, arXiv
2404.06910; PCED, arXiv 2601.08670, combines the paths token by token).

- ``paths``: the request is answered on the likeliest path (ties: the
  earlier document);
- ``choose``: on the documents whose score per token is within a margin of
  the best (at least one, at most k, the likeliest first), jointly, in the
  client's order: ``head + kept documents + tail + question`` as one exact
  prompt, the first kept document found in vLLM's prefix cache (its path's
  prefix), the others computed after it. One kept: exactly ``paths``.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.v1.request import Request

from vllm_kvreuse.core.request_keys import DOCUMENTS

MODES = ("joint", "paths", "choose")
"""``--chunk-attention``: ``joint`` (one prompt, chunks loaded or computed in
place), ``paths`` or ``choose`` (this module)."""
REQUEST_KEY = "chunk_attention"
"""Public request field: this request's attention mode (else the server's)."""


def parse_attention(value: Any) -> str:
    """A ``chunk_attention`` field, or ``ValueError``."""
    if value not in MODES:
        raise ValueError(f"{REQUEST_KEY} must be one of {', '.join(MODES)}")
    return value


def parse_documents(value: Any) -> list[int]:
    """The internal ``kvreuse_documents`` key: ``[first, end)`` chunk indices
    of a chunked prompt's documents, ``1 <= first <= end`` (none: equal)."""
    if (
        not isinstance(value, Sequence)
        or isinstance(value, (str, bytes))
        or len(value) != 2
        or not all(type(n) is int for n in value)
        or not 1 <= value[0] <= value[1]
    ):
        raise ValueError(f"{DOCUMENTS} must be [first, end) chunk indices")
    return list(value)


@dataclass(frozen=True, slots=True)
class Layout:
    """A chunked prompt cut into head chunks, documents, tail chunks and the
    question (token ids)."""

    head: list[list[int]]
    documents: list[list[int]]
    tail: list[list[int]]
    question: list[int]

    def prompt(self, kept: Sequence[int]) -> tuple[list[int], list[int]]:
        """The prompt of the documents ``kept`` (indices, in that order) with
        the head and tail, and its chunk lengths."""
        chunks = [*self.head, *(self.documents[i] for i in kept), *self.tail]
        tokens = [token for chunk in chunks for token in chunk]
        return [*tokens, *self.question], [len(chunk) for chunk in chunks]

    def path(self, document: int) -> Path:
        tokens, lengths = self.prompt([document])
        prefix = sum(len(chunk) for chunk in self.head) + lengths[len(self.head)]
        return Path(tokens, lengths, prefix, document)


@dataclass(slots=True)
class Path:
    """``head + document + tail + question``: its chunk ``lengths``, and
    ``prefix``, the tokens up to the end of its document."""

    tokens: list[int]
    lengths: list[int]
    prefix: int
    document: int = 0
    score: float | None = None

    @property
    def per_token(self) -> float:
        """The score per scored token (every token after the document but
        the first)."""
        assert self.score is not None
        return self.score / max(len(self.tokens) - self.prefix - 1, 1)


def layout_of(
    prompt: list[int], lengths: list[int], documents: Sequence[int] | None = None
) -> Layout | None:
    """The layout of a chunked prompt whose documents are the chunks
    ``documents`` ``[first, end)`` (default: every chunk after the first);
    None with fewer than two documents (nothing to choose)."""
    first, end = documents or (1, len(lengths))
    end = min(end, len(lengths))
    if end - first < 2:
        return None
    starts = [0, *itertools.accumulate(lengths)]
    chunks = [prompt[a:b] for a, b in itertools.pairwise(starts)]
    return Layout(chunks[:first], chunks[first:end], chunks[end:], prompt[starts[-1] :])


def paths_of(
    prompt: list[int], lengths: list[int], documents: Sequence[int] | None = None
) -> list[Path]:
    """One path per document of a chunked prompt; none with fewer than two."""
    layout = layout_of(prompt, lengths, documents)
    if layout is None:
        return []
    return [layout.path(d) for d in range(len(layout.documents))]


def question_score(logprobs: Any, num_tokens: int, prefix: int) -> float:
    """Sum of the log-probs of a path's tokens after its document, after the
    first.

    ``logprobs``: the prompt log-probs vLLM returned (``LogprobsTensors``:
    column 0 the prompt token's own), one row per prompt position computed,
    row ``r`` scoring token ``r + 1``. The V1 runner returns every row of the
    prompt (rows of a cached prefix unset), the V2 runner the computed rows
    only; both end at row ``num_tokens - 2``.
    """
    rows = logprobs.logprobs[:, 0]
    first_row = num_tokens - 1 - rows.shape[0]
    return float(rows[prefix - first_row : num_tokens - 1 - first_row].sum())


def kept_documents(paths: Sequence[Path], margin: float, k: int) -> list[int]:
    """The documents within ``margin`` (per token) of the best path, the
    likeliest ``k`` of them (ties: the earlier), in the client's order."""
    best = max(path.per_token for path in paths)
    close = [p for p in paths if p.per_token >= best - margin]
    ranked = sorted(close, key=lambda p: (-p.per_token, p.document))[: max(k, 1)]
    return sorted(path.document for path in ranked)


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
