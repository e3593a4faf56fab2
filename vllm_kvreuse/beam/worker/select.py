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

The candidates (:mod:`.candidates`: fixed shapes on an accelerator, a
pruned set on CPU) are then ranked by an exact stable sort of their
scores, per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvreuse.beam.worker.candidates import (
    Runs,
    eos_in_reach,
    row_candidates,
    threshold_candidates,
)
from vllm_kvreuse.beam.worker.segments import (
    Segments,
    best_per_group,
    carriers_per_group,
)


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

    def packed(self, member: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(next [W, 5], beams [B, 4])`` float64 (``member``: each next
        beam's carrier; :class:`~vllm_kvreuse.beam.plan.PackedResult`'s
        rows), copied to the host without waiting (pinned memory on an
        accelerator)."""
        nxt = torch.stack(
            (self.parents.double(), self.tokens.double(), self.scores,
             member.double(), self.valid.double()),
            dim=1,
        )  # fmt: skip
        beams = torch.stack(
            (self.eos_done.double(), self.eos_scores, self.leaf_done.double(),
             torch.zeros_like(self.eos_scores)),
            dim=1,
        )  # fmt: skip
        if nxt.device.type == "cpu":
            return nxt, beams
        return nxt.to("cpu", non_blocking=True), beams.to("cpu", non_blocking=True)


def logprobs_of(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """vLLM's raw log-probs (``Sampler.compute_logprobs``): float32
    ``log_softmax``, into ``out`` if given. A -0.0 log-prob compares equal
    to +0.0 and adds to a score as +0.0: the step ranks by value, never by
    bits."""
    return torch.log_softmax(logits, dim=-1, dtype=torch.float32, out=out)


def eos_rows(
    logprobs: torch.Tensor,
    seg: Segments,
    sampled: torch.Tensor | None,
    runs: Runs | None = None,
    order: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per beam, whether EOS ends it, and EOS's log-prob (0 where the
    group has no EOS): it is finite and ranks in the row's best
    ``row_size`` (ties to the lower token id), or the sampler drew it.
    With ``runs`` (the pruned path) only the runs reaching EOS are counted
    (:func:`.candidates.eos_in_reach`); else the whole rows. ``order``: as
    for :func:`select_rows` (``sampled`` in beam order)."""
    eos = seg.row_eos
    ends = eos >= 0
    token = eos.clamp(min=0)  # a row's EOS is its group's, in either order
    lp = logprobs.gather(1, token[:, None]).squeeze(1)
    done = None if runs is None else eos_in_reach(runs, lp, seg)
    if done is None:
        done = _eos_ranks(logprobs, lp, seg) < seg.row_limit
    lp, done = in_beam_order(lp, order), in_beam_order(done, order)
    if sampled is not None:
        done |= sampled.view(-1) == token
    done &= ends & torch.isfinite(lp)
    return done, torch.where(ends, lp, 0.0)


def _eos_ranks(logprobs: torch.Tensor, lp: torch.Tensor, seg: Segments) -> torch.Tensor:
    """Per row, how many tokens rank ahead of its EOS (fixed shapes)."""
    at = lp[:, None]
    ids = {e for e in seg.eos_ids if e >= 0}
    if len(ids) == 1:  # one model, one EOS: a tie below it is ahead of it
        (first,) = ids
        ahead = (logprobs[:, :first] >= at).sum(dim=1, dtype=torch.int32)
        return ahead + (logprobs[:, first + 1 :] > at).sum(dim=1, dtype=torch.int32)
    token = seg.row_eos.clamp(min=0)
    lower = torch.arange(logprobs.shape[1], device=logprobs.device) < token[:, None]
    ahead = (logprobs > at).sum(dim=1, dtype=torch.int32)
    return ahead + ((logprobs == at) & lower).sum(dim=1, dtype=torch.int32)


def in_beam_order(values: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """``values`` of the rows (first dimension), in beam order."""
    return values if order is None else values[order]


def select_rows(
    logprobs: torch.Tensor,
    cum: torch.Tensor,
    seg: Segments,
    sampled: torch.Tensor | None = None,
    fixed: bool | None = None,
    alive: torch.Tensor | None = None,
    order: torch.Tensor | None = None,
) -> Selection:
    """A step of every group of ``seg`` over whole vocabulary rows
    ``logprobs [R, V]`` (:func:`logprobs_of` the raw logits, a tensor it
    may write; ``cum [R]`` float64): next beams ``[sum(width)]``, per-beam
    results ``[R]``. ``fixed``: fixed shapes (default: on every device but
    CPU). ``alive [R]``: beams that exist (default all); the others offer
    nothing and never end. ``order [R]``: the row of ``logprobs`` holding
    each beam, within the beam's group (default: row ``b`` holds beam
    ``b``), so that rows in the workers' member order need no copy; every
    other tensor is in beam order."""
    alive = _all_alive(cum) if alive is None else alive
    if fixed is None:
        fixed = logprobs.device.type != "cpu"
    runs = None if fixed else Runs.of(logprobs, seg)
    if runs is None:
        cands = row_candidates(logprobs, seg, alive, order)
    else:
        cands = threshold_candidates(logprobs, cum, seg, alive, runs, order)
    parents, tokens, scores, valid = best_per_group(
        seg, cands.beams, cands.tokens, cands.logprobs, cands.valid, cum
    )
    none = torch.zeros(len(cum), dtype=torch.bool, device=logprobs.device)
    if any(e >= 0 for e in seg.eos_ids):
        eos_done, eos_lp = eos_rows(logprobs, seg, sampled, runs, order)
        eos_done &= alive
        ends = seg.row_eos >= 0
        eos_scores = torch.where(ends, cum + eos_lp.double(), 0.0)
    else:
        eos_done, eos_scores = none, torch.zeros_like(cum)
    return Selection(parents, tokens, scores, valid, eos_done, eos_scores, none)


def select_catalog_rows(
    logprobs: torch.Tensor,
    cum: torch.Tensor,
    seg: Segments,
    children: torch.Tensor,
    at_leaf: torch.Tensor,
    alive: torch.Tensor | None = None,
    order: torch.Tensor | None = None,
) -> Selection:
    """A step of every catalog group of ``seg`` (``logprobs`` and
    ``order`` as for :func:`select_rows`): ``children [R, M]`` each
    beam's legal next tokens (-1: none; :meth:`SidCatalog.legal`),
    ``at_leaf [R]``.

    Log-probs are the whole row's (not renormalised inside the catalog);
    only the legal tokens' are ranked, ``R x M`` candidates."""
    num_rows = len(cum)
    alive = _all_alive(cum) if alive is None else alive
    at_leaf = at_leaf & alive
    legal = (children >= 0) & alive[:, None]
    beams = torch.arange(num_rows, device=logprobs.device)[:, None]
    rows = beams if order is None else order[:, None]
    lp = logprobs[rows, children.clamp(min=0)].masked_fill_(~legal, float("-inf"))
    beams = beams.expand_as(children)
    parents, tokens, scores, valid = best_per_group(
        seg, beams.reshape(-1), children.reshape(-1), lp.reshape(-1),
        torch.isfinite(lp).reshape(-1), cum,
    )  # fmt: skip
    eos = seg.row_eos
    ends = eos >= 0
    eos_lp = logprobs[rows.squeeze(1), eos.clamp(min=0)]
    eos_lp = torch.where(ends, eos_lp, 0.0)
    eos_done = at_leaf & ends & torch.isfinite(eos_lp)
    leaf_done = at_leaf & ~eos_done
    return Selection(
        parents, tokens, scores, valid, eos_done, cum + eos_lp.double(), leaf_done
    )


def _all_alive(cum: torch.Tensor) -> torch.Tensor:
    return torch.ones(len(cum), dtype=torch.bool, device=cum.device)


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
    return select_rows(logprobs_of(logits), cum, seg, sampled, fixed, alive)


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
    return select_catalog_rows(logprobs_of(logits), cum, seg, children, at_leaf, alive)


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
