"""Where a rendered chat is cut into chunks, and the check that the cut is exact.

Pure text and token logic, no vLLM: :mod:`vllm_kvreuse.chunk_cache.frontend.chat`
renders the conversation through the served model's chat template and hands
the texts here.

A rendering is cut at offsets into its text: where each message but the last
ends (from renderings of the first k messages), and around each document
(from renderings with the first j documents). The resulting segments may be
split further at the server's ``--chunk-separator``, which is dropped. Each
piece is then tokenised on its own, and the tokens of every piece, separators
included, must be exactly the tokens vLLM gave the whole rendering; if they
are not, the request is refused (:class:`ChatSplitError`), never split
wrongly. So the chunked prompt is vLLM's own prompt minus the separators'
tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any


class ChatSplitError(ValueError):
    """A chat request that cannot be chunked as asked (HTTP 400)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """A run of the rendered text: a segment (model input) or a separator
    (tokenised only to check the cut, then dropped)."""

    text: str
    separator: bool = False


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def message_cuts(prefixes: Sequence[str], full: str) -> list[int]:
    """Offsets into ``full`` where each of ``prefixes`` ends.

    ``prefixes[k]`` is the rendering of the first k + 1 messages without a
    generation prompt; each must be a prefix of the next and of ``full``,
    and longer than the one before (a message the template renders as
    nothing would be an empty chunk).
    """
    cuts: list[int] = []
    for number, text in enumerate(prefixes, start=1):
        if not full.startswith(text):
            at = _common_prefix(text, full)
            raise ChatSplitError(
                f"the chat template renders the first {number} message(s) as a "
                "text that is not a prefix of the whole conversation's rendering "
                f"(they differ at character {at}: {text[at : at + 30]!r} against "
                f"{full[at : at + 30]!r}): it renders earlier messages differently "
                "once later ones follow, so the conversation cannot be cut at "
                "message boundaries; send it without chunk_messages"
            )
        if len(text) <= (cuts[-1] if cuts else 0):
            raise ChatSplitError(
                f"the chat template renders message {number - 1} as nothing; "
                "an empty chunk is refused"
            )
        cuts.append(len(text))
    return cuts


def document_spans(full: str, without: Sequence[str]) -> list[tuple[int, int]]:
    """Each document's ``(start, end)`` in ``full``.

    ``without[j]`` is the same conversation rendered without document j.
    Each must be ``full`` less one run of text (the document as the template
    renders it), the runs in document order. Where a run could start at
    several offsets (the same characters before and after it), the earliest
    after the previous document is taken: a template's per-document wrapper
    usually opens with what it closes with.
    """
    spans: list[tuple[int, int]] = []
    for number, rest in enumerate(without):
        if rest == full:
            raise ChatSplitError(
                "the chat template does not render `documents` (leaving out "
                f"document {number} changes nothing): this model's template "
                "ignores vLLM's documents field; send the documents as messages "
                "with chunk_messages"
            )
        size = len(full) - len(rest)
        latest = _common_prefix(full, rest)
        earliest = len(rest) - _common_prefix(full[::-1], rest[::-1])
        start = max(earliest, spans[-1][1] if spans else 0)
        if size <= 0 or earliest > latest:
            raise ChatSplitError(
                f"the chat template changes other text when document {number} is "
                "left out (it is not one run of the rendering), so it cannot be "
                "cut at documents; send the documents as messages with "
                "chunk_messages"
            )
        if start > latest:
            raise ChatSplitError(
                f"the chat template renders document {number} before document "
                f"{number - 1}, so it cannot be cut at documents"
            )
        spans.append((start, start + size))
    return spans


def cut(text: str, offsets: Sequence[int]) -> list[str]:
    """``text`` cut at ``offsets`` (any order; duplicates, 0 and the end ignored)."""
    bounds = [0, *sorted({o for o in offsets if 0 < o < len(text)}), len(text)]
    return [text[a:b] for a, b in pairwise(bounds)]


def split_at_separator(segments: Sequence[str], separator: str) -> list[Piece]:
    """``segments`` as model-input pieces, each also split at ``separator``
    (empty: none), with the separators as pieces of their own.

    Raises :class:`ChatSplitError` for an empty segment (a leading, trailing
    or doubled separator), as a text prompt's separator is refused.
    """
    pieces: list[Piece] = []
    for segment in segments:
        parts = segment.split(separator) if separator else [segment]
        if any(not part for part in parts):
            raise ChatSplitError(
                "empty segment in a chunked prompt (separator "
                f"{separator!r}) in the rendered conversation"
            )
        for number, part in enumerate(parts):
            if number:
                pieces.append(Piece(separator, separator=True))
            pieces.append(Piece(part))
    return pieces


def tokenize_pieces(
    pieces: Sequence[Piece], tokenizer: Any, add_special_tokens: bool
) -> list[list[int]]:
    """Each piece tokenised alone; the first with ``add_special_tokens`` (as
    the whole rendering was), the others without."""
    return [
        tokenizer.encode(piece.text, add_special_tokens=add_special_tokens and not n)
        for n, piece in enumerate(pieces)
    ]


def check_tokens(
    pieces: Sequence[Piece], tokens: Sequence[Sequence[int]], rendered: Sequence[int]
) -> None:
    """Raises :class:`ChatSplitError` unless the pieces' tokens, in order, are
    exactly ``rendered`` (vLLM's tokens of the whole rendering)."""
    position = 0
    for number, (piece, ids) in enumerate(zip(pieces, tokens, strict=True)):
        if list(rendered[position : position + len(ids)]) != list(ids):
            where = (
                f"separator {piece.text!r}"
                if piece.separator
                else f"segment {number} ({piece.text[:30]!r}...)"
            )
            raise ChatSplitError(
                f"the tokenizer merges text across a chunk boundary at {where}: "
                "tokenised alone, the chunks would not be the tokens vLLM "
                "renders for these messages, so the request is not chunked"
            )
        position += len(ids)
    if position != len(rendered):
        raise ChatSplitError(
            "the chunks' tokens are not the tokens vLLM renders for these "
            "messages (the rendering has more tokens), so the request is not "
            "chunked"
        )


def segment_tokens(
    pieces: Sequence[Piece], tokens: Sequence[list[int]]
) -> list[list[int]]:
    """The model-input pieces' tokens (separators dropped): the segments."""
    pairs = zip(pieces, tokens, strict=True)
    return [ids for piece, ids in pairs if not piece.separator]


def document_range(pieces: Sequence[Piece], start: int, stop: int) -> list[int]:
    """``[first, end)``: the segments (the model-input pieces, in order) that
    start within ``[start, stop)`` of the rendering, neither the first (the
    system prompt) nor the last (the question); ``[1, 1]`` for none. Only
    these are documents, candidates of answer paths."""
    offsets, at = [], 0
    for piece in pieces:
        if not piece.separator:
            offsets.append(at)
        at += len(piece.text)
    inside = [n for n, o in enumerate(offsets[:-1]) if n and start <= o < stop]
    return [inside[0], inside[-1] + 1] if inside else [1, 1]
