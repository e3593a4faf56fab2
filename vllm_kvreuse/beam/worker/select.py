"""The beam step next to the logits: each group's next beams from its rows.

Pure torch on the logits' device, free of vLLM: the worker runs it inside
the sampler (:mod:`vllm_kvreuse.beam.worker.job`), tests run it on CPU
tensors. For a group of ``B`` beams (rows of logits) and width ``W`` it
returns ``W`` (parent beam, token, score) triples and, per beam, whether it
completes: nothing of a ``[B, V]`` log-prob row leaves the device. A step's
groups are selected together, laid end to end
(:mod:`~vllm_kvreuse.beam.worker.segments`): each group's answer is the one
it gets alone, and the operations do not multiply with the groups.

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

Two selections give that same answer. :func:`row_candidates` has fixed
shapes (no host sync, for CUDA under async scheduling): each row's best
``W`` by a packed ``(logprob, -token)`` int64 key, then an exact stable
sort of the ``B x W`` scores. :func:`threshold_candidates` (CPU, where a sync is
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

from vllm_kvreuse.beam.worker.segments import (
    Segments,
    best_per_group,
    carriers_per_group,
    group_counts,
)

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
    logprobs: torch.Tensor, seg: Segments, sampled: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, whether EOS ends the beam, and EOS's log-prob (0 where the
    group has no EOS): it is finite and ranks in the row's best
    ``row_size`` (ties to the lower token id), or the sampler drew it."""
    eos = seg.eos[seg.group]
    ends = eos >= 0
    token = eos.clamp(min=0)
    lp = logprobs.gather(1, token[:, None]).squeeze(1)
    above = (logprobs > lp[:, None]).sum(dim=1)
    lower = torch.arange(logprobs.shape[1], device=logprobs.device) < token[:, None]
    above += ((logprobs == lp[:, None]) & lower).sum(dim=1)
    done = above < seg.row_size[seg.group]
    if sampled is not None:
        done |= sampled.view(-1) == token
    done &= ends & torch.isfinite(lp)
    return done, torch.where(ends, lp, 0.0)


def _without_eos(logprobs: torch.Tensor, seg: Segments, fill: float) -> torch.Tensor:
    """A copy of ``logprobs`` with each row's EOS (where its group has one)
    set to ``fill``: EOS never competes for a place."""
    if all(e < 0 for e in seg.eos_ids):
        return logprobs
    eos = seg.eos[seg.group]
    token = eos.clamp(min=0)[:, None]
    kept = logprobs.gather(1, token)
    replaced = torch.where(eos[:, None] >= 0, torch.full_like(kept, fill), kept)
    return logprobs.clone().scatter_(1, token, replaced)


def row_candidates(logprobs: torch.Tensor, seg: Segments) -> Candidates:
    """Each row's best ``max(width)`` (fixed shapes), as :class:`Candidates`
    (a row of a narrower group offers more than it needs: its group's best
    are among them); a row's EOS is never one."""
    num_rows, vocab = logprobs.shape
    tokens = torch.arange(vocab, device=logprobs.device)
    keys = packed_keys(logprobs, tokens.expand(num_rows, vocab))
    keys = _without_eos(keys, seg, NO_KEY)
    top, picked = keys.topk(min(max(seg.widths), vocab), dim=1)
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
    logprobs: torch.Tensor, cum: torch.Tensor, seg: Segments
) -> Candidates:
    """Every candidate that can be among its group's best ``width``
    (data-dependent shapes; CPU). Each row's best few give a score at least
    ``width`` of its group's candidates reach (``bound``, exact in float64;
    -inf where the group has fewer candidates than places); a row whose few
    are all at or above it may hold more and is scanned whole for finite
    candidates scoring at least ``bound`` (an exact float64 bound applied
    to float32 log-probs); every other row's candidates are among its few."""
    num_rows, vocab = logprobs.shape
    masked = _without_eos(logprobs, seg, float("-inf"))
    pairs = zip(seg.widths, seg.rows, strict=True)
    few = min(vocab, max(max(1, -(-4 * w // r)) for w, r in pairs))
    top = masked.topk(few, dim=1)
    scores = top.values.double() + cum[:, None]
    bound = _group_bounds(seg, scores)[seg.group]
    full = scores[:, -1] >= bound  # rows that may hold more than their few
    keep = (scores >= bound[:, None]) & ~full[:, None] & torch.isfinite(scores)
    beams = torch.arange(num_rows)[:, None].expand_as(keep)[keep]
    tokens = top.indices[keep]
    rows = full.nonzero().flatten()
    if len(rows):
        floor = bound[rows] - cum[rows]  # a candidate's least log-prob, float64
        low = floor.float()
        low = torch.where(
            low.double() > floor, low.nextafter(low.new_tensor(-1e38)), low
        )
        scan = masked[rows]
        more = (scan >= low[:, None]) & torch.isfinite(scan)
        more_rows, more_tokens = more.nonzero(as_tuple=True)
        beams = torch.cat((beams, rows[more_rows]))
        tokens = torch.cat((tokens, more_tokens))
    order = torch.argsort(beams * vocab + tokens)  # (beam, token) order
    return _candidates(logprobs, beams[order], tokens[order])


def _group_bounds(seg: Segments, scores: torch.Tensor) -> torch.Tensor:
    """``[G]``: each group's ``width``-th best finite score among its rows'
    ``scores [R, few]``; -inf where it has fewer."""
    few = scores.shape[1]
    flat = scores.flatten()
    groups = seg.group.repeat_interleave(few)
    order = torch.sort(-flat, stable=True).indices
    order = order[torch.sort(groups[order], stable=True).indices]
    kth = seg.row_start * few + torch.minimum(seg.width, seg.num_rows * few) - 1
    bound = flat[order[kth]]
    enough = group_counts(seg, groups, torch.isfinite(flat)) >= seg.width
    return torch.where(enough, bound, float("-inf"))


def _candidates(
    logprobs: torch.Tensor, beams: torch.Tensor, tokens: torch.Tensor
) -> Candidates:
    valid = torch.ones(len(beams), dtype=torch.bool, device=logprobs.device)
    return Candidates(beams, tokens, logprobs[beams, tokens], valid)


def select_rows(
    logits: torch.Tensor,
    cum: torch.Tensor,
    seg: Segments,
    sampled: torch.Tensor | None = None,
    fixed: bool | None = None,
    alive: torch.Tensor | None = None,
) -> Selection:
    """A step of every group of ``seg`` over whole vocabulary rows
    ``logits [R, V]`` (``cum [R]`` float64): next beams ``[sum(width)]``,
    per-row results ``[R]``. ``fixed``: fixed shapes (default: on every
    device but CPU). ``alive [R]``: rows that carry a beam (default all);
    the others offer nothing and never end."""
    logprobs = _alive_rows(logprobs_of(logits), alive)
    if fixed is None:
        fixed = logits.device.type != "cpu"
    if fixed:
        cands = row_candidates(logprobs, seg)
    else:
        cands = threshold_candidates(logprobs, cum, seg)
    parents, tokens, scores, valid = best_per_group(
        seg, cands.beams, cands.tokens, cands.logprobs, cands.valid, cum
    )
    none = torch.zeros(len(cum), dtype=torch.bool, device=logits.device)
    if any(e >= 0 for e in seg.eos_ids):
        eos_done, eos_lp = eos_rows(logprobs, seg, sampled)
        ends = seg.eos[seg.group] >= 0
        eos_scores = torch.where(ends, cum + eos_lp.double(), 0.0)
    else:
        eos_done, eos_scores = none, torch.zeros_like(cum)
    return Selection(parents, tokens, scores, valid, eos_done, eos_scores, none)


def select_catalog_rows(
    logits: torch.Tensor,
    cum: torch.Tensor,
    seg: Segments,
    children: torch.Tensor,
    at_leaf: torch.Tensor,
    alive: torch.Tensor | None = None,
) -> Selection:
    """A step of every catalog group of ``seg``: ``children [R, M]`` each
    beam's legal next tokens (-1: none; :meth:`SidCatalog.legal`),
    ``at_leaf [R]``.

    Log-probs are the whole row's (not renormalised inside the catalog);
    only the legal tokens' are ranked, ``R x M`` candidates."""
    num_rows = len(cum)
    logprobs = _alive_rows(logprobs_of(logits), alive)
    if alive is not None:
        at_leaf = at_leaf & alive
    legal = children >= 0
    lp = logprobs.gather(1, children.clamp(min=0)).masked_fill_(~legal, float("-inf"))
    beams = torch.arange(num_rows, device=logits.device)[:, None].expand_as(children)
    parents, tokens, scores, valid = best_per_group(
        seg, beams.reshape(-1), children.reshape(-1), lp.reshape(-1),
        torch.isfinite(lp).reshape(-1), cum,
    )  # fmt: skip
    eos = seg.eos[seg.group]
    ends = eos >= 0
    eos_lp = logprobs.gather(1, eos.clamp(min=0)[:, None]).squeeze(1)
    eos_lp = torch.where(ends, eos_lp, 0.0)
    eos_done = at_leaf & ends & torch.isfinite(eos_lp)
    leaf_done = at_leaf & ~eos_done
    return Selection(
        parents, tokens, scores, valid, eos_done, cum + eos_lp.double(), leaf_done
    )


def one_group(rule: Rule, num_rows: int, device: torch.device) -> Segments:
    return Segments.of([num_rows], [rule.width], [rule.eos], [rule.row_size], device)


def select_plain(
    logits: torch.Tensor,
    cum: torch.Tensor,
    rule: Rule,
    sampled: torch.Tensor | None = None,
    fixed: bool | None = None,
    alive: torch.Tensor | None = None,
) -> Selection:
    """:func:`select_rows` for one group of ``len(cum)`` beams."""
    seg = one_group(rule, len(cum), logits.device)
    return select_rows(logits, cum, seg, sampled, fixed, alive)


def select_catalog(
    logits: torch.Tensor,
    cum: torch.Tensor,
    rule: Rule,
    children: torch.Tensor,
    at_leaf: torch.Tensor,
    alive: torch.Tensor | None = None,
) -> Selection:
    """:func:`select_catalog_rows` for one group of ``len(cum)`` beams."""
    seg = one_group(rule, len(cum), logits.device)
    return select_catalog_rows(logits, cum, seg, children, at_leaf, alive)


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
    :func:`vllm_kvreuse.beam.scheduler.live.carriers`; for many groups at
    once, :func:`.segments.carriers_per_group`.
    """
    seg = Segments.of([num_members], [len(parents)], [-1], [0], parents.device)
    return carriers_per_group(seg, parents, valid)
