"""The beam step next to the logits: one group's next beams from its rows.

Pure torch on the logits' device, free of vLLM: the worker runs it inside
the sampler (:mod:`vllm_kvreuse.beam.worker.job`), tests run it on CPU
tensors. For a group of ``B`` beams (rows of logits) and width ``W`` it
returns ``W`` (parent beam, token, score) triples and, per beam, whether it
completes: nothing of a ``[B, V]`` log-prob row leaves the device.

The rule is :mod:`vllm_kvreuse.beam.rule`'s (vLLM's front-end rule) with
one total order for ties, the same on host and device:

- a beam's candidates are its tokens with a finite log-prob
  (``log_softmax`` of the raw logits, float32), inside its trie node when
  the group is constrained to a SID catalog;
- a candidate's score is ``float64(cum) + float64(logprob)``, exactly as
  the host adds them;
- where EOS ends a beam (an EOS id, not ``ignore_eos``), EOS completes a
  beam when it ranks among the beam's best ``row_size`` candidates (by
  log-prob, ties to the lower token id; or it is the token the sampler
  drew), and never competes for a place; at a catalog leaf it is the only
  candidate; a catalog leaf that may not take EOS completes as it is;
- the next beams are the best ``W`` other candidates by score, ties to the
  lower beam index, then the lower token id.

Two selections give that same answer. :func:`select_fixed` has fixed
shapes (no host sync, for CUDA under async scheduling): each row's best
``W`` by a packed ``(logprob, -token)`` int64 key, then an exact stable
sort of the ``B x W`` scores. :func:`select_pruned` (CPU, where a sync is
free and a per-row top-``W`` of a wide vocabulary is the cost) finds a
score that at least ``W`` candidates reach from each row's best few, keeps
every candidate at or above it, and sorts only those.

Within one row, score order equals log-prob order: two different float32
log-probs of one distribution differ by more than a float64 rounding of any
reachable cumulative score, so a row's best ``W`` by log-prob hold every
candidate of that row the global order can pick.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NO_KEY = torch.iinfo(torch.int64).min
"""Packed key of a token that is no candidate (sorts below every real one)."""


@dataclass(frozen=True, slots=True)
class Rule:
    """What a group's step needs besides its rows (see the module docstring).

    ``eos``: EOS ends a beam with this token (-1: nothing ends a beam);
    ``row_size``: how deep EOS may rank in its row and still end a beam.
    """

    width: int
    eos: int = -1
    row_size: int = 0


@dataclass(frozen=True, slots=True)
class Selection:
    """One group's step, on the rows' device.

    Next beams, best first, ``[W]``: ``parents`` (beam index), ``tokens``,
    ``scores`` (float64), ``valid`` (fewer candidates than ``W``: the rest
    are not beams). Per current beam, ``[B]``: ``eos_done`` and
    ``eos_scores`` (the beam ended by EOS, with that score), ``leaf_done``
    (a catalog item completed as it is, at its cumulative score).
    """

    parents: torch.Tensor
    tokens: torch.Tensor
    scores: torch.Tensor
    valid: torch.Tensor
    eos_done: torch.Tensor
    eos_scores: torch.Tensor
    leaf_done: torch.Tensor


@dataclass(frozen=True, slots=True)
class Candidates:
    """Candidates in (beam, token) order: beam index, token, float32
    log-prob; ``valid`` False for padding."""

    beams: torch.Tensor
    tokens: torch.Tensor
    logprobs: torch.Tensor
    valid: torch.Tensor


def logprobs_of(logits: torch.Tensor) -> torch.Tensor:
    """vLLM's raw log-probs (``Sampler.compute_logprobs``): float32
    ``log_softmax``, with -0.0 made +0.0 so that equal values tie."""
    return logits.log_softmax(dim=-1, dtype=torch.float32).add_(0.0)


def packed_keys(logprobs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """int64 keys ordering ``(logprob desc, token asc)`` as plain integers:
    the float's bits made monotone in the high half, ``~token`` in the low
    half. Non-finite log-probs get :data:`NO_KEY`."""
    bits = logprobs.contiguous().view(torch.int32).long()
    monotone = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    keys = (monotone << 32) | (0xFFFFFFFF - tokens.long())
    return keys.masked_fill_(~torch.isfinite(logprobs), NO_KEY)


def eos_rows(
    logprobs: torch.Tensor, rule: Rule, sampled: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, whether EOS ends the beam, and EOS's log-prob: it is finite
    and ranks in the row's best ``row_size`` (ties to the lower token id),
    or the sampler drew it."""
    eos = rule.eos
    lp = logprobs[:, eos]
    above = (logprobs > lp[:, None]).sum(dim=1)
    above += (logprobs[:, :eos] == lp[:, None]).sum(dim=1)
    done = above < rule.row_size
    if sampled is not None:
        done |= sampled.view(-1) == eos
    return done & torch.isfinite(lp), lp


def row_candidates(logprobs: torch.Tensor, k: int, exclude: int) -> Candidates:
    """Each row's best ``k`` (fixed shapes), as :class:`Candidates`;
    ``exclude`` (a token id, or -1) is never one."""
    num_rows, vocab = logprobs.shape
    tokens = torch.arange(vocab, device=logprobs.device)
    keys = packed_keys(logprobs, tokens.expand(num_rows, vocab))
    if exclude >= 0:
        keys[:, exclude] = NO_KEY
    top, picked = keys.topk(min(k, vocab), dim=1)
    picked, order = picked.sort(dim=1)  # (beam, token) order for the tie rule
    top = top.gather(1, order)
    beams = torch.arange(num_rows, device=logprobs.device)[:, None].expand_as(picked)
    return Candidates(
        beams.reshape(-1),
        picked.reshape(-1),
        logprobs.gather(1, picked).reshape(-1),
        (top != NO_KEY).reshape(-1),
    )


def threshold_candidates(
    logprobs: torch.Tensor, cum: torch.Tensor, width: int, exclude: int
) -> Candidates:
    """Every candidate that can be among the best ``width`` (data-dependent
    shapes; CPU). Each row's best few give a score at least ``width``
    candidates reach (``bound``, exact in float64); a row whose few are all
    at or above it may hold more and is scanned whole for candidates
    scoring at least ``bound`` (an exact float64 bound applied to float32
    log-probs); every other row's candidates are among its few."""
    num_rows, vocab = logprobs.shape
    masked = logprobs
    if exclude >= 0:
        masked = logprobs.clone()
        masked[:, exclude] = float("-inf")
    few = min(vocab, max(1, -(-4 * width // num_rows)))
    top = masked.topk(few, dim=1)
    scores = top.values.double() + cum[:, None]
    finite = scores[torch.isfinite(scores)]
    if len(finite) < width:  # fewer candidates than places: all of them
        beams, tokens = torch.isfinite(masked).nonzero(as_tuple=True)
        return _candidates(logprobs, beams, tokens)
    bound = finite.topk(width).values[-1]
    full = scores[:, -1] >= bound  # rows that may hold more than their few
    keep = (scores >= bound) & ~full[:, None]
    beams = torch.arange(num_rows)[:, None].expand_as(keep)[keep]
    tokens = top.indices[keep]
    rows = full.nonzero().flatten()
    if len(rows):
        floor = bound - cum[rows]  # a candidate's least log-prob, float64
        low = floor.float()
        low = torch.where(
            low.double() > floor, low.nextafter(low.new_tensor(-1e38)), low
        )
        more_rows, more_tokens = (masked[rows] >= low[:, None]).nonzero(as_tuple=True)
        beams = torch.cat((beams, rows[more_rows]))
        tokens = torch.cat((tokens, more_tokens))
    order = torch.argsort(beams * vocab + tokens)  # (beam, token) order
    return _candidates(logprobs, beams[order], tokens[order])


def _candidates(
    logprobs: torch.Tensor, beams: torch.Tensor, tokens: torch.Tensor
) -> Candidates:
    valid = torch.ones(len(beams), dtype=torch.bool, device=logprobs.device)
    return Candidates(beams, tokens, logprobs[beams, tokens], valid)


def best_candidates(
    cands: Candidates, cum: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best ``width`` of ``cands`` (in (beam, token) order): score
    desc, ties kept in that order (stable sorts); padded to ``width`` with
    invalid entries. Returns ``(beams, tokens, scores, valid)``."""
    scores = cum[cands.beams] + cands.logprobs.double()
    order = torch.sort(-scores, stable=True).indices
    invalid = (~cands.valid[order]).to(torch.int8)
    order = order[torch.sort(invalid, stable=True).indices]
    order = order[:width]
    beams, tokens = cands.beams[order], cands.tokens[order]
    scores, valid = scores[order], cands.valid[order]
    missing = width - len(order)
    if missing > 0:
        pad = torch.zeros(missing, dtype=beams.dtype, device=beams.device)
        beams, tokens = torch.cat((beams, pad)), torch.cat((tokens, pad))
        scores = torch.cat((scores, pad.double()))
        valid = torch.cat((valid, pad.bool()))
    return beams, tokens, scores, valid


def select_plain(
    logits: torch.Tensor,
    cum: torch.Tensor,
    rule: Rule,
    sampled: torch.Tensor | None = None,
    fixed: bool | None = None,
    alive: torch.Tensor | None = None,
) -> Selection:
    """A step over whole vocabulary rows ``logits [B, V]`` (``cum [B]``
    float64). ``fixed``: fixed shapes (default: on every device but CPU).
    ``alive [B]``: rows that carry a beam (default all); the others offer
    nothing and never end."""
    logprobs = _alive_rows(logprobs_of(logits), alive)
    if fixed is None:
        fixed = logits.device.type != "cpu"
    if fixed:
        cands = row_candidates(logprobs, rule.width, rule.eos)
    else:
        cands = threshold_candidates(logprobs, cum, rule.width, rule.eos)
    beams, tokens, scores, valid = best_candidates(cands, cum, rule.width)
    num_rows = len(cum)
    none = torch.zeros(num_rows, dtype=torch.bool, device=logits.device)
    if rule.eos >= 0:
        eos_done, eos_lp = eos_rows(logprobs, rule, sampled)
        eos_scores = cum + eos_lp.double()
    else:
        eos_done, eos_scores = none, torch.zeros_like(cum)
    return Selection(beams, tokens, scores, valid, eos_done, eos_scores, none)


def select_catalog(
    logits: torch.Tensor,
    cum: torch.Tensor,
    rule: Rule,
    children: torch.Tensor,
    at_leaf: torch.Tensor,
    alive: torch.Tensor | None = None,
) -> Selection:
    """A step of a catalog group: ``children [B, M]`` each beam's legal
    next tokens (-1: none; :meth:`SidCatalog.legal`), ``at_leaf [B]``.

    Log-probs are the whole row's (not renormalised inside the catalog);
    only the legal tokens' are ranked, ``B x M`` candidates."""
    num_rows = len(cum)
    logprobs = _alive_rows(logprobs_of(logits), alive)
    if alive is not None:
        at_leaf = at_leaf & alive
    legal = children >= 0
    lp = logprobs.gather(1, children.clamp(min=0)).masked_fill_(~legal, float("-inf"))
    beams = torch.arange(num_rows, device=logits.device)[:, None].expand_as(children)
    finite = torch.isfinite(lp)
    cands = Candidates(
        beams.reshape(-1), children.reshape(-1), lp.reshape(-1), finite.reshape(-1)
    )
    beams, tokens, scores, valid = best_candidates(cands, cum, rule.width)
    if rule.eos >= 0:
        eos_lp = logprobs[:, rule.eos]
        eos_done = at_leaf & torch.isfinite(eos_lp)
    else:
        eos_lp = torch.zeros_like(cum, dtype=torch.float32)
        eos_done = torch.zeros_like(at_leaf)
    leaf_done = at_leaf & ~eos_done
    return Selection(
        beams, tokens, scores, valid, eos_done, cum + eos_lp.double(), leaf_done
    )


def _alive_rows(logprobs: torch.Tensor, alive: torch.Tensor | None) -> torch.Tensor:
    """``logprobs`` with the rows of no beam at -inf: no candidate, no EOS."""
    if alive is None:
        return logprobs
    return logprobs.masked_fill_(~alive[:, None], float("-inf"))


def carriers(
    parents: torch.Tensor, valid: torch.Tensor, num_members: int
) -> torch.Tensor:
    """Which member row carries each next beam (fixed shapes; -1: none).

    Members ``0 .. B - 1`` carry this step's beams in beam order (further
    members carry none). A parent's first child keeps the parent's member;
    each further child, in rank order, takes the next *spare* (a member
    whose beam has no child, then the idle ones, in member order); a child
    left without a spare gets -1. Mirrors
    :func:`vllm_kvreuse.beam.scheduler.live.carriers`.
    """
    device = parents.device
    width = len(parents)
    ranks = torch.arange(width, device=device)
    slot = torch.where(valid, parents, num_members)  # invalid: a dummy member
    first = torch.full((num_members + 1,), width, device=device, dtype=torch.long)
    first.scatter_reduce_(0, slot, ranks, reduce="amin")
    is_first = valid & (first[slot] == ranks)
    has_child = first[:num_members] < width
    spares = torch.sort(has_child.to(torch.int8), stable=True).indices
    num_spares = num_members - has_child.sum()
    extra = valid & ~is_first
    nth = torch.cumsum(extra.long(), 0) - 1
    spare = spares[nth.clamp(min=0, max=max(num_members - 1, 0))]
    carrier = torch.where(is_first, parents, torch.where(nth < num_spares, spare, -1))
    return torch.where(valid, carrier, -1)
