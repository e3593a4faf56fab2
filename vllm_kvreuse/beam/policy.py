"""The beam-search step rule, as vLLM's front-end beam search applies it.

Free of scheduler state. Each live beam offers the tokens of its top
``2 * width`` log-probabilities (the sampled token first, as vLLM's sampler
puts it, duplicates counted once); a candidate ending in EOS completes a beam
unless ``ignore_eos``; the other candidates compete by cumulative log-prob and
the best ``width`` live on. Ties are broken exactly as the front end breaks
them: candidates are listed beam by beam in that token order and ranked with
the same numpy calls. At the end, completed and live beams are ranked by
vLLM's own length-penalised score (``create_sort_beams_key_function``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
from vllm.entrypoints.generate.beam_search.utils import (
    BeamSearchSequence,
    create_sort_beams_key_function,
)

CONFIG_KEY = "kvreuse_beam"
"""``extra_args`` key of a beam-search root request; its value is a config dict."""

NODE_KEY = "kvreuse_sid_node"
"""Internal ``extra_args`` key: the SID-catalog trie node a catalog beam's
next token continues from (0, the root, for the group's first step)."""

LEAF_EOS_KEY = "kvreuse_sid_eos"
"""Internal ``extra_args`` key: the token allowed after a whole item (EOS),
absent when a beam at a leaf may not take one (no EOS, ``ignore_eos``)."""


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
        raw = (extra_args or {}).get(CONFIG_KEY)
        return cls.parse(raw) if raw else None

    @classmethod
    def parse(cls, raw: Any) -> BeamConfig:
        """A config from its dict form, every field checked (``ValueError``)."""
        names = {f.name for f in fields(cls)}
        if not isinstance(raw, dict) or not names >= set(raw) >= _REQUIRED:
            raise ValueError(f"{CONFIG_KEY} must be a dict with keys {sorted(names)}")
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

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


MAX_WIDTH = 1024
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


def logprob_row(
    token_ids: Sequence[int], logprobs: Sequence[float], width: int
) -> dict[int, float]:
    """The (token, logprob) pairs the front end sees for one position."""
    row: dict[int, float] = {}
    n = 2 * width + 1
    for token, logprob in zip(token_ids[:n], logprobs[:n], strict=True):
        row.setdefault(int(token), float(logprob))
    return row


def expand(
    beams: Sequence[Beam], rows: Sequence[dict[int, float]], config: BeamConfig
) -> Step:
    """One beam-search step from each live beam's log-prob row."""
    step = Step()
    candidates: list[tuple[float, int, Beam]] = []
    for beam, row in zip(beams, rows, strict=True):
        for token, logprob in row.items():
            cum_logprob = beam.seq.cum_logprob + logprob
            if token == config.eos_token_id and not config.ignore_eos:
                tokens = (
                    [*beam.seq.tokens, token]
                    if config.include_stop_str_in_output
                    else beam.seq.tokens
                )
                done = BeamSearchSequence(
                    orig_prompt=beam.seq.orig_prompt, tokens=tokens, logprobs=[],
                    cum_logprob=cum_logprob, finish_reason="stop", stop_reason=token,
                )  # fmt: skip
                step.completed.append(done)
            else:
                candidates.append((cum_logprob, token, beam))
    scores = np.fromiter(
        (c[0] for c in candidates), dtype=np.float64, count=len(candidates)
    )
    if len(candidates) <= config.width:
        order = np.argsort(-scores)
    else:
        order = np.argpartition(-scores, config.width - 1)[: config.width]
        order = order[np.argsort(-scores[order])]
    for index in order:
        cum_logprob, token, parent = candidates[int(index)]
        seq = BeamSearchSequence(
            orig_prompt=parent.seq.orig_prompt, tokens=[*parent.seq.tokens, token],
            logprobs=[], cum_logprob=cum_logprob,
        )  # fmt: skip
        step.beams.append((seq, parent.request_id))
    return step


def best(
    completed: list[BeamSearchSequence],
    live: list[BeamSearchSequence],
    config: BeamConfig,
) -> list[BeamSearchSequence]:
    """The final ``width`` beams, best first."""
    key = create_sort_beams_key_function(config.eos_token_id, config.length_penalty)
    return sorted([*completed, *live], key=key, reverse=True)[: config.width]
