"""Which (beam, token) pairs may be among their group's next beams.

A superset of each group's best ``width`` candidates, ties at the cut
included, in (beam, token) order: ranking it (:func:`.segments.best_per_group`)
gives the answer ranking every (beam, token) pair would. A beam's
candidates are its tokens with a finite log-prob but EOS (where EOS ends
beams: it never competes for a place); a row that carries no beam
(``alive`` False) offers none.

Two ways, one answer (:mod:`.select`): :func:`row_candidates` in fixed
shapes (no host sync: CUDA under async scheduling), each row's best
``width``; :func:`threshold_candidates`
(CPU, where a sync is free and a per-row top-``k`` of a wide vocabulary is
the cost), everything at or above a score that at least ``width`` of the
group's candidates reach.

Within one row, score order equals log-prob order: two different float32
log-probs of one distribution differ by more than a float64 rounding of any
reachable cumulative score, so a row's best ``W`` by log-prob hold every
candidate of that row the global order can pick.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_kvreuse.beam.worker.segments import Segments, group_counts

CHUNK = 64
""":func:`threshold_candidates`'s bound is found among each run of this many
tokens' maximum."""


@dataclass(frozen=True, slots=True)
class Candidates:
    """Candidates in (beam, token) order: beam index, token, float32
    log-prob; ``valid`` False for padding."""

    beams: torch.Tensor
    tokens: torch.Tensor
    logprobs: torch.Tensor
    valid: torch.Tensor


def without_eos(values: torch.Tensor, seg: Segments, fill: float) -> torch.Tensor:
    """``values [R, V]``, or a copy with each row's EOS (where its group has
    one) set to ``fill``."""
    if all(e < 0 for e in seg.eos_ids):
        return values
    eos = seg.row_eos
    token = eos.clamp(min=0)[:, None]
    kept = values.gather(1, token)
    replaced = torch.where(eos[:, None] >= 0, torch.full_like(kept, fill), kept)
    return values.clone().scatter_(1, token, replaced)


def row_candidates(
    logprobs: torch.Tensor,
    seg: Segments,
    alive: torch.Tensor,
    order: torch.Tensor | None = None,
) -> Candidates:
    """Each row's best ``max(width)`` by (log-prob desc, token asc), fixed
    shapes (a row of a narrower group offers more than it needs: its
    group's best are among them).

    A float top-``k`` takes them, but for the places tied at its last
    value, where a kernel may take any of the tied tokens (bfloat16 logits
    tie often): those go to the lowest tied tokens, a second top-``k`` over
    int32 keys of the tied positions. Four passes over ``R x V``, each of
    4 bytes an element (a top-``k``, a compare, a select, a top-``k``).
    ``order``: the row holding each beam (:func:`.select.select_rows`);
    the picks are put in beam order, ``R x k``."""
    num_rows, vocab = logprobs.shape
    device = logprobs.device
    k = min(max(seg.widths), vocab)
    values = without_eos(logprobs, seg, float("-inf"))
    top, picked = values.topk(k, dim=1)  # best first
    last = top[:, -1:]
    above = (top > last).sum(dim=1, keepdim=True)  # they lead ``picked``
    reverse = torch.arange(vocab, 0, -1, dtype=torch.int32, device=device)
    tied = torch.where(values == last, reverse, 0)  # vocab - token; 0: not tied
    first_tied = vocab - tied.topk(k, dim=1).values  # vocab: no token
    place = torch.arange(k, device=device)[None, :]
    from_ties = first_tied.gather(1, (place - above).clamp(min=0))
    tokens = torch.where(place < above, picked, from_ties).sort(dim=1).values
    real = tokens < vocab  # a NaN row ties nothing
    tokens = tokens.clamp(max=vocab - 1)
    valid = real & (values.gather(1, tokens) > float("-inf"))
    lps = logprobs.gather(1, tokens)
    if order is not None:
        tokens, valid, lps = tokens[order], valid[order], lps[order]
    valid &= alive[:, None]
    beams = torch.arange(num_rows, device=device)[:, None].expand_as(tokens)
    return Candidates(
        beams.reshape(-1),
        tokens.reshape(-1),
        lps.reshape(-1),
        valid.reshape(-1),
    )


@dataclass(frozen=True, slots=True)
class Runs:
    """Rows ``[R, V]`` cut into runs of :data:`CHUNK` tokens: ``values
    [R, C, CHUNK]`` (a view where ``CHUNK`` divides ``V``, else padded with
    -inf) and each run's maximum ``maxima [R, C]``, the row's EOS left out
    where its group has one (EOS never competes for a place)."""

    values: torch.Tensor
    maxima: torch.Tensor

    @classmethod
    def of(cls, logprobs: torch.Tensor, seg: Segments) -> Runs:
        """One pass over the rows; EOS's run is taken again without it
        (``R x CHUNK``), not the rows copied to mask it."""
        values = _runs(logprobs)
        maxima = values.amax(dim=2)
        if any(e >= 0 for e in seg.eos_ids):
            eos = seg.row_eos
            rows = torch.arange(len(eos), device=logprobs.device)
            token = eos.clamp(min=0)
            run = token // CHUNK
            own = values[rows, run]  # a copy
            own[rows, token % CHUNK] = float("-inf")
            maxima[rows, run] = torch.where(
                eos >= 0, own.amax(dim=1), maxima[rows, run]
            )
        return cls(values, maxima)


def threshold_candidates(
    logprobs: torch.Tensor,
    cum: torch.Tensor,
    seg: Segments,
    alive: torch.Tensor,
    runs: Runs,
    order: torch.Tensor | None = None,
) -> Candidates:
    """Every candidate scoring at least a bound that at least ``width`` of
    its group's candidates reach (data-dependent shapes; CPU).

    Rows are cut into runs of :data:`CHUNK` tokens (``runs``:
    :meth:`Runs.of` the rows). The bound: the group's ``width``-th best
    score among each row's best few run maxima (distinct candidates); -inf
    where the group has fewer, and then every finite candidate of the
    group. Only the runs whose maximum reaches the bound are scanned, so the
    cost past one pass is the candidates', not ``R x V``. ``order``: the
    row holding each beam (:func:`.select.select_rows`)."""
    maxima = runs.maxima if order is None else runs.maxima[order]
    pairs = zip(seg.widths, seg.rows, strict=True)
    few = min(maxima.shape[1], max(max(1, -(-4 * w // r)) for w, r in pairs))
    scores = _best_few(maxima, few).double() + cum[:, None]
    scores = torch.where(alive[:, None], scores, float("-inf"))
    bound = _group_bounds(seg, scores)[seg.group]
    low = _low(torch.where(alive, bound - cum, float("inf")))  # dead rows: none
    rows, run = _reaching(maxima, low).nonzero(as_tuple=True)
    held = rows if order is None else order[rows]
    hits, offset = _reaching(runs.values[held, run], low[rows]).nonzero(as_tuple=True)
    beams, tokens = rows[hits], run[hits] * CHUNK + offset
    if any(e >= 0 for e in seg.eos_ids):  # EOS never competes for a place
        keep = tokens != seg.row_eos[beams]
        beams, tokens = beams[keep], tokens[keep]
    held = beams if order is None else order[beams]
    valid = torch.ones(len(beams), dtype=torch.bool, device=logprobs.device)
    return Candidates(beams, tokens, logprobs[held, tokens], valid)  # (beam, token)


def eos_in_reach(
    runs: Runs, eos_logprobs: torch.Tensor, seg: Segments
) -> torch.Tensor | None:
    """Per row, whether its EOS ranks among the row's best ``row_size``
    (ties to the lower token id; data-dependent shapes, CPU). A run whose
    maximum is above EOS's log-prob holds a token ahead of it: with
    ``row_size`` such runs EOS is out; otherwise only the runs reaching it
    are counted, not the whole row. None where most runs reach it (a
    ``row_size`` near the vocabulary's): counting whole rows costs less."""
    at = eos_logprobs[:, None]
    limit = seg.row_limit
    sure = (runs.maxima > at).sum(dim=1)
    open_ = sure < limit
    reach = (runs.maxima >= at) & open_[:, None]
    rows, run = reach.nonzero(as_tuple=True)
    if 2 * len(rows) > reach.numel():
        return None
    values, at = runs.values[rows, run], at[rows]
    tokens = (run * CHUNK)[:, None] + torch.arange(CHUNK, device=run.device)
    ahead = (values > at) | ((values == at) & (tokens < seg.row_eos[rows][:, None]))
    counts = torch.zeros_like(sure).index_add_(0, rows, ahead.sum(dim=1))
    return open_ & (counts < limit)


def _runs(values: torch.Tensor) -> torch.Tensor:
    """``values [R, V]`` as ``[R, ceil(V / CHUNK), CHUNK]`` (a view where
    ``CHUNK`` divides ``V``, else padded with -inf)."""
    num_rows, vocab = values.shape
    pad = -vocab % CHUNK
    if pad:
        values = torch.nn.functional.pad(values, (0, pad), value=float("-inf"))
    return values.view(num_rows, -1, CHUNK)


def _best_few(maxima: torch.Tensor, few: int) -> torch.Tensor:
    """Each row's ``few`` largest values ``[R, few]``, in no order. On CPU
    a partition (numpy's; NaN largest, as in a top-k): torch's top-k of
    a few out of a short row costs six times as much there."""
    if few == maxima.shape[1]:
        return maxima
    if maxima.device.type != "cpu" or maxima.dtype != torch.float32:
        return maxima.topk(few, dim=1, sorted=False).values
    kept = np.partition(maxima.numpy(), -few, axis=1)[:, -few:]
    return torch.from_numpy(kept)


def _low(floor: torch.Tensor) -> torch.Tensor:
    """``floor [R]`` (bound - cum, float64) as the least float32 log-prob
    whose float64 score reaches the bound (rounded down: exact)."""
    low = floor.float()
    return torch.where(low.double() > floor, low.nextafter(low.new_tensor(-1e38)), low)


def _reaching(values: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """``values [K, N] >= low [K]``, finite values only."""
    reached = values >= low[:, None]
    if not bool(torch.isfinite(low).all()):  # -inf reaches -inf: not a candidate
        reached &= values > float("-inf")
    return reached


def _group_bounds(seg: Segments, scores: torch.Tensor) -> torch.Tensor:
    """``[G]``: each group's ``width``-th best finite score among its rows'
    ``scores [R, k]``; -inf where it has fewer."""
    k = scores.shape[1]
    flat = scores.flatten()
    groups = seg.group.repeat_interleave(k)
    order = torch.sort(-flat, stable=True).indices
    order = order[torch.sort(groups[order], stable=True).indices]
    kth = seg.row_start * k + torch.minimum(seg.width, seg.num_rows * k) - 1
    bound = flat[order[kth]]
    enough = group_counts(seg, groups, torch.isfinite(flat)) >= seg.width
    return torch.where(enough, bound, float("-inf"))
