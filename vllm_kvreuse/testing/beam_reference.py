"""Reference: one beam step by brute force over whole log-prob rows.

Tests only. The rule of :mod:`vllm_kvreuse.beam.worker.select`, written the
slowest obvious way in numpy: every (beam, token) pair is a candidate,
scored in float64 and sorted by (score desc, beam asc, token asc).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class ReferenceStep:
    """Next beams best first (``parents``, ``tokens``, ``scores``; as many
    as there are candidates, at most ``width``) and, per beam, EOS and leaf
    completions (``eos_scores`` meaningful where ``eos_done``)."""

    parents: np.ndarray
    tokens: np.ndarray
    scores: np.ndarray
    eos_done: np.ndarray
    eos_scores: np.ndarray
    leaf_done: np.ndarray


def reference_step(
    logprobs: np.ndarray,
    cum: np.ndarray,
    width: int,
    eos: int = -1,
    row_size: int = 0,
    sampled: np.ndarray | None = None,
    legal: np.ndarray | None = None,
    at_leaf: np.ndarray | None = None,
) -> ReferenceStep:
    """``logprobs [B, V]`` float32, ``cum [B]`` float64; ``eos`` -1 when
    nothing ends a beam; ``legal``/``at_leaf``: a catalog group's legal
    tokens and leaves (EOS is legal at a leaf only, when it ends beams)."""
    num_beams, vocab = logprobs.shape
    finite = np.isfinite(logprobs)
    candidate = finite.copy()
    if legal is not None:
        candidate &= legal
    if eos >= 0:
        candidate[:, eos] = False
    beams, tokens = np.nonzero(candidate)
    scores = cum[beams] + logprobs[beams, tokens].astype(np.float64)
    order = np.lexsort((tokens, beams, -scores))[:width]
    eos_done = np.zeros(num_beams, dtype=bool)
    eos_scores = np.zeros(num_beams)
    leaf_done = np.zeros(num_beams, dtype=bool)
    if eos >= 0:
        lp = logprobs[:, eos]
        eos_scores = cum + lp.astype(np.float64)
        if legal is None:
            ids = np.arange(vocab)[None, :]
            ahead = (logprobs > lp[:, None]) | ((logprobs == lp[:, None]) & (ids < eos))
            eos_done = ahead.sum(axis=1) < row_size
            if sampled is not None:
                eos_done |= sampled == eos
            eos_done &= np.isfinite(lp)
        else:
            assert at_leaf is not None
            eos_done = at_leaf & np.isfinite(lp)
    if at_leaf is not None:
        leaf_done = at_leaf & ~eos_done
    return ReferenceStep(
        beams[order], tokens[order], scores[order], eos_done, eos_scores, leaf_done
    )
