"""Which chunk tokens a chunked request recomputes instead of loading.

Loaded chunk KV was computed with the chunk alone; a *recomputed* span is
prefilled in the request itself, attending causally to everything before it
(loaded or recomputed). A request's recomputed spans are chosen here, from
its segments and its settings, as sorted disjoint ``(start, end)`` ranges of
prompt positions inside its chunks. Three rules, combined by union:

- **head** (EPIC, arXiv 2410.15332): the first ``head`` tokens of every
  chunk after the first. Computed alone, every chunk begins like a prompt:
  its first tokens turn into attention sinks and nothing in it says which
  document it is. Recomputed with the real preceding context, they are
  neither.
- **select** (question-driven, in the spirit of ProphetKV and A³): up to
  ``select`` of the chunk tokens, spent on the chunks most relevant to the
  question (tf-idf of the question's tokens: names and places weigh, words
  in every chunk do not), most relevant first, each from its start.
- **tail**: the last ``tail`` of all chunk tokens, the system prompt's
  included (the question's neighbours), as ``--chunk-recompute-fraction``
  always did; it never reaches into the system prompt.

Every span costs the request one engine step (a contiguous prefill between
two loads), so the rules produce few, long runs rather than scattered
tokens. The first chunk (the system prompt) is never recomputed: it starts
the prompt, so its stored KV is what full attention computes.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Span = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Recompute:
    """A request's recompute settings (all off: load every chunk).

    ``head``: tokens per chunk; ``select`` and ``tail``: shares of the chunk
    tokens in [0, 1].
    """

    head: int = 0
    select: float = 0.0
    tail: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.head or self.select or self.tail)

    def tag(self) -> str:
        """A short stable name, for cache salts and logs."""
        return f"h{self.head}s{self.select!r}t{self.tail!r}"

    def to_dict(self) -> dict[str, Any]:
        """As a request carries it (:func:`carry_recompute`)."""
        return {"head": self.head, "select": self.select, "tail": self.tail}


REQUEST_KEY = "chunk_recompute"
"""Public request field: this request's recompute settings, replacing the
server's: ``"none"`` (load every chunk: the fastest, least accurate), or an
object with any of ``head`` (tokens), ``select`` and ``tail`` (shares)."""


def parse_recompute(value: Any) -> Recompute:
    """A ``chunk_recompute`` field as settings, or ``ValueError``."""
    if value == "none":
        return Recompute()
    if not isinstance(value, dict) or not value or set(value) - set(_FIELDS):
        raise ValueError(
            f'{REQUEST_KEY} must be "none" or an object with any of '
            f"{', '.join(_FIELDS)}"
        )
    head = value.get("head", 0)
    if type(head) is not int or not 0 <= head <= 4096:
        raise ValueError(f"{REQUEST_KEY}.head must be a token count in [0, 4096]")
    shares = {}
    for name in ("select", "tail"):
        share = value.get(name, 0)
        if type(share) not in (int, float) or not 0 <= share <= 1:
            raise ValueError(f"{REQUEST_KEY}.{name} must be a number in [0, 1]")
        shares[name] = float(share)
    return Recompute(head=head, **shares)


def carry_recompute(value: Any) -> dict[str, Any]:
    """A ``chunk_recompute`` field checked, as the request carries it to the
    engine (every field set; ``Recompute(**carried)`` there)."""
    return parse_recompute(value).to_dict()


_FIELDS = ("head", "select", "tail")


def choose_spans(
    prompt: Sequence[int], lengths: Sequence[int], settings: Recompute
) -> list[Span]:
    """The spans of ``prompt`` to recompute, sorted and disjoint.

    ``lengths`` are the chunks' token counts from position 0; the question
    is ``prompt[sum(lengths):]``.
    """
    if not settings or len(lengths) < 2:
        return []
    starts = [0]
    for length in lengths[:-1]:
        starts.append(starts[-1] + length)
    end = starts[-1] + lengths[-1]
    body = end - lengths[0]  # chunk tokens after the system prompt
    spans: list[Span] = []
    if settings.head:
        heads = zip(starts[1:], lengths[1:], strict=True)
        spans += [(s, s + min(settings.head, n)) for s, n in heads]
    if settings.select:
        budget = round(settings.select * body)
        for number in _by_relevance(prompt, starts, lengths, end):
            if budget <= 0:
                break
            take = min(budget, lengths[number])
            spans.append((starts[number], starts[number] + take))
            budget -= take
    if settings.tail:  # a share of all chunk tokens, as it always was
        tail = min(round(settings.tail * end), body)
        if tail:
            spans.append((end - tail, end))
    return merge(spans)


def _by_relevance(
    prompt: Sequence[int], starts: list[int], lengths: Sequence[int], end: int
) -> list[int]:
    """Chunks after the first that share a rare token with the question,
    most relevant first (ties: earlier first).

    Relevance is tf-idf over the question's distinct tokens: a token counts
    its occurrences in the chunk times ``log(chunks / chunks holding it)``,
    so a token in every chunk (a template marker, "the") counts nothing and
    the chunk that names the question's subject most often comes first.
    """
    question = set(prompt[end:])
    counts = [
        Counter(t for t in prompt[s : s + n] if t in question)
        for s, n in zip(starts[1:], lengths[1:], strict=True)
    ]
    spread = Counter(token for held in counts for token in held)
    num_chunks = len(counts)
    scores = [
        sum(n * math.log(num_chunks / spread[t]) for t, n in held.items())
        for held in counts
    ]
    ranked = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return [i + 1 for i in ranked if scores[i] > 0]


def merge(spans: list[Span]) -> list[Span]:
    """``spans`` sorted, with overlapping or touching ones joined."""
    merged: list[Span] = []
    for start, stop in sorted(s for s in spans if s[1] > s[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


def clip(spans: list[Span], ranges: list[Span]) -> list[Span]:
    """The parts of ``spans`` inside ``ranges`` (both sorted and disjoint)."""
    return merge(
        [
            (max(a, lo), min(b, hi))
            for a, b in spans
            for lo, hi in ranges
            if max(a, lo) < min(b, hi)
        ]
    )
