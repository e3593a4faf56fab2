"""The beam-search step rule, as vLLM's front-end beam search applies it.

Free of scheduler state. Each live beam offers the tokens of its top
``2 * width`` log-probabilities (the sampled token first, as vLLM's sampler
puts it, duplicates counted once; ``width`` suffice when no candidate can end
a beam, :attr:`BeamConfig.row_size`); a candidate ending in EOS completes a beam
unless ``ignore_eos``; the other candidates compete by cumulative log-prob and
the best ``width`` live on. Ties go to the lower beam index, then the lower
token id (:func:`rank`: one total order, shared with the device step,
:mod:`vllm_kvreuse.beam.worker.select`). At the end, completed and live beams are
ranked by vLLM's own length-penalised score (``create_sort_beams_key_function``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
from vllm.entrypoints.generate.beam_search.utils import (
    BeamSearchSequence,
    create_sort_beams_key_function,
)

from vllm_kvreuse.core.request_keys import BEAM


def parse_token_id(value: Any) -> int:
    if not _is_int(value) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class BeamConfig:
    width: int
    max_tokens: int
    eos_token_id: int | None
    length_penalty: float = 1.0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    sid_catalog: bool = False  # beams constrained to the server's SID catalog

    @classmethod
    def from_extra_args(cls, extra_args: dict[str, Any] | None) -> BeamConfig | None:
        """A root request's config as the frontend wrote it; None for any
        other request. Not checked again: :meth:`parse_carried` checked it
        when the request passed validation (``vllm_kvreuse.request_args``),
        the one parse it gets; the group carries the result from then on."""
        raw = (extra_args or {}).get(BEAM)
        return cls(**raw) if raw else None

    @classmethod
    def parse_carried(cls, raw: Any) -> dict[str, Any]:
        """``raw`` checked (:meth:`parse`), as the root request carries it to
        the engine (:meth:`from_extra_args` builds the config from it)."""
        return cls.parse(raw).to_dict()

    @classmethod
    def parse(cls, raw: Any) -> BeamConfig:
        """A config from its dict form, every field checked (``ValueError``)."""
        names = {f.name for f in fields(cls)}
        if not isinstance(raw, dict) or not names >= set(raw) >= _REQUIRED:
            raise ValueError(f"{BEAM} must be a dict with keys {sorted(names)}")
        config = cls(**raw)
        if not _is_int(config.width) or not 1 <= config.width <= MAX_WIDTH:
            raise ValueError(f"beam width must be an integer in [1, {MAX_WIDTH}]")
        if not _is_int(config.max_tokens) or config.max_tokens < 1:
            raise ValueError("beam max_tokens must be a positive integer")
        eos = config.eos_token_id
        if eos is not None and (not _is_int(eos) or eos < 0):
            raise ValueError("beam eos_token_id must be a token id or null")
        penalty = config.length_penalty
        if not isinstance(penalty, (int, float)) or not math.isfinite(penalty):
            raise ValueError("beam length_penalty must be a finite number")
        flags = (
            config.ignore_eos,
            config.include_stop_str_in_output,
            config.sid_catalog,
        )
        if not all(isinstance(flag, bool) for flag in flags):
            raise ValueError(
                "beam ignore_eos, include_stop_str_in_output and sid_catalog are bools"
            )
        return config

    @property
    def row_size(self) -> int:
        """How many top log-probs each beam's request returns for a step.

        vLLM's rule offers each beam's top ``2 * width`` candidates: EOS among
        them completes a beam, the rest compete for ``width`` places. When no
        candidate can end a beam (``ignore_eos``, or no EOS) a row's top
        ``width`` select the same beams: a candidate below its own row's
        ``width``-th best has ``width`` better ones in that row alone, so it
        is never kept (up to exact ties at that boundary). Half the log-probs
        halve the sampler's top-k, vLLM's per-row log-prob lists and the
        ranking; semantic-ID stage 2 runs this way (fixed-length items,
        ``ignore_eos``).
        """
        if self.eos_token_id is None or self.ignore_eos:
            return self.width
        return 2 * self.width

    @property
    def num_logprobs(self) -> int:
        """The ``logprobs`` each beam's request asks vLLM for: ``row_size``,
        plus the catalog mask's sink, which may take one of the places."""
        return self.row_size + int(self.sid_catalog)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


MAX_WIDTH = 1 << 16  # the engine's own limits (seats, step tokens) come first
_REQUIRED = {"width", "max_tokens", "eos_token_id"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(slots=True)
class Beam:
    """A live beam: its sequence, and the engine request holding its KV."""

    seq: BeamSearchSequence
    request_id: str
    node: int = 0  # SID catalog trie node (catalog beams only)


@dataclass(slots=True)
class Step:
    """Result of one step: the next live beams, each naming its parent beam."""

    beams: list[tuple[BeamSearchSequence, str]] = field(default_factory=list)
    completed: list[BeamSearchSequence] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Row:
    """One beam's candidates: tokens and their log-probs in offer order, each
    token once. Arrays, so that a step over ``width`` beams of ``2 * width``
    candidates each runs in numpy, not in a Python loop per candidate."""

    tokens: np.ndarray  # int64 [k]
    logprobs: np.ndarray  # float64 [k]

    @classmethod
    def of(cls, pairs: Mapping[int, float]) -> Row:
        """A row from ``{token: logprob}``, in the mapping's order."""
        n = len(pairs)
        return cls(
            np.fromiter(pairs.keys(), dtype=np.int64, count=n),
            np.fromiter(pairs.values(), dtype=np.float64, count=n),
        )

    def __len__(self) -> int:
        return len(self.tokens)

    def items(self) -> list[tuple[int, float]]:
        return list(zip(self.tokens.tolist(), self.logprobs.tolist(), strict=True))


def logprob_row(
    token_ids: Sequence[int] | np.ndarray,
    logprobs: Sequence[float] | np.ndarray,
    size: int,
) -> Row:
    """The (token, logprob) pairs the front end sees for one position: the
    first ``size + 1`` (``size`` is :attr:`BeamConfig.num_logprobs`; a batch's
    rows are as wide as its widest request's), a repeated token (the sampled
    one, which the sampler puts first and which recurs in the top-k) kept at
    its first place.

    Only the sampled token can repeat (top-k tokens are distinct), so one
    comparison against it replaces a sort-based dedup (a wide step reads
    ``width`` rows of ``size + 1``).
    """
    n = size + 1
    tokens = np.asarray(token_ids[:n], dtype=np.int64)
    values = np.asarray(logprobs[:n], dtype=np.float64)
    if len(tokens) > 1:
        again = tokens[1:] == tokens[0]
        if again.any():
            keep = np.concatenate(([True], ~again))
            tokens, values = tokens[keep], values[keep]
    return Row(tokens, values)


def expand(
    beams: Sequence[Beam], rows: Sequence[Row | Mapping[int, float]], config: BeamConfig
) -> Step:
    """One beam-search step from each live beam's log-prob row.

    A candidate has a finite log-prob; EOS (unless ignored) completes a
    beam; the best ``width`` other candidates by score live on, ties to the
    lower beam index, then the lower token id (:func:`rank`). The device
    step (:mod:`vllm_kvreuse.beam.worker.select`) selects with the same order.
    """
    step = Step()
    arrays = [row if isinstance(row, Row) else Row.of(row) for row in rows]
    if not arrays:
        return step
    tokens = np.concatenate([row.tokens for row in arrays])
    owner = np.repeat(np.arange(len(arrays)), [len(row) for row in arrays])
    cum = np.fromiter((b.seq.cum_logprob for b in beams), np.float64, len(beams))
    scores = cum[owner] + np.concatenate([row.logprobs for row in arrays])
    finite = np.isfinite(scores)
    if config.eos_token_id is not None and not config.ignore_eos:
        ends = finite & (tokens == config.eos_token_id)
    else:
        ends = np.zeros(len(tokens), dtype=bool)
    for index in np.flatnonzero(ends).tolist():
        beam, token = beams[owner[index]], int(tokens[index])
        step.completed.append(
            BeamSearchSequence(
                orig_prompt=beam.seq.orig_prompt,
                tokens=[*beam.seq.tokens, token]
                if config.include_stop_str_in_output
                else beam.seq.tokens,
                logprobs=[], cum_logprob=float(scores[index]),
                finish_reason="stop", stop_reason=token,
            )
        )  # fmt: skip
    candidates = np.flatnonzero(finite & ~ends)
    order = rank(
        scores[candidates], owner[candidates], tokens[candidates], config.width
    )
    for index in candidates[order].tolist():
        parent = beams[owner[index]]
        seq = BeamSearchSequence(
            orig_prompt=parent.seq.orig_prompt,
            tokens=[*parent.seq.tokens, int(tokens[index])],
            logprobs=[], cum_logprob=float(scores[index]),
        )  # fmt: skip
        step.beams.append((seq, parent.request_id))
    return step


def rank(
    scores: np.ndarray, owner: np.ndarray, tokens: np.ndarray, width: int
) -> np.ndarray:
    """The best ``width`` candidates' indices, best first, in the order
    score desc, then beam index asc, then token id asc.

    One total order, so that the host and the device step pick the same
    beams whatever their sorting algorithms do with equal scores. (vLLM's
    front-end loop ranks with ``np.argpartition``, whose choice among equal
    scores depends on the array's layout; its offline loop sorts stably in
    candidate order. Both agree with this order where scores differ.)
    """
    keep = np.arange(len(scores))
    if len(scores) > width:  # only candidates at or above the width-th score
        kth = np.partition(-scores, width - 1)[width - 1]
        keep = np.flatnonzero(-scores <= kth)
    order = np.lexsort((tokens[keep], owner[keep], -scores[keep]))
    return keep[order[:width]]


def best(
    completed: list[BeamSearchSequence],
    live: list[BeamSearchSequence],
    config: BeamConfig,
) -> list[BeamSearchSequence]:
    """The final ``width`` beams, best first."""
    key = create_sort_beams_key_function(config.eos_token_id, config.length_penalty)
    return sorted([*completed, *live], key=key, reverse=True)[: config.width]


def step_from_result(
    parents: Sequence[int],
    tokens: Sequence[int],
    scores: Sequence[float],
    eos_scores: Sequence[float | None],
    leaf_done: Sequence[bool],
    beams: Sequence[Beam],
    config: BeamConfig,
) -> Step:
    """The :class:`Step` a device step chose (:mod:`vllm_kvreuse.beam.worker.select`):
    next beams best first, each naming its parent beam's request; completed
    beams as the host lists them (catalog items complete as they are first,
    then EOS endings, each in beam order)."""
    step = Step()
    for beam, done in zip(beams, leaf_done, strict=True):
        if done:
            seq = beam.seq
            step.completed.append(
                BeamSearchSequence(
                    orig_prompt=seq.orig_prompt, tokens=seq.tokens, logprobs=[],
                    cum_logprob=seq.cum_logprob, finish_reason="length",
                )
            )  # fmt: skip
    eos = config.eos_token_id
    for beam, score in zip(beams, eos_scores, strict=True):
        if score is not None and eos is not None:
            seq = beam.seq
            step.completed.append(
                BeamSearchSequence(
                    orig_prompt=seq.orig_prompt,
                    tokens=[*seq.tokens, eos]
                    if config.include_stop_str_in_output
                    else seq.tokens,
                    logprobs=[], cum_logprob=score,
                    finish_reason="stop", stop_reason=eos,
                )
            )  # fmt: skip
    for parent, token, score in zip(parents, tokens, scores, strict=True):
        beam = beams[parent]
        seq = BeamSearchSequence(
            orig_prompt=beam.seq.orig_prompt,
            tokens=[*beam.seq.tokens, token],
            logprobs=[], cum_logprob=score,
        )  # fmt: skip
        step.beams.append((seq, beam.request_id))
    return step
