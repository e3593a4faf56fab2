"""Many groups' beam steps as one: groups laid end to end in flat tensors.

A step's groups are selected together (:mod:`.select`), so the number of
tensor operations, and of launches on an accelerator, does not grow with
the number of groups. Group ``g`` owns rows ``row_start[g] ..
row_start[g] + num_rows[g]`` (its beam slots, one per member) and next-beam
slots ``out_start[g] .. out_start[g] + width[g]``. Every function here is
the one-group rule applied to each group independently: nothing of one
group changes another's answer (``tests/unit/test_beam_select.py`` checks a
batch against its groups one at a time).

Fixed shapes throughout, and host data copied without waiting
(:func:`to_device`): no host sync, as the selections run under async
scheduling on CUDA.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from vllm.utils import torch_utils


@dataclass(frozen=True, slots=True)
class Segments:
    """The layout of a batch of groups (module docstring), built on the
    host and sent in one copy: each row's and each slot's group fields are
    read in place, not gathered per use.

    Per group ``[G]``: ``row_start``, ``num_rows``, ``width``, ``out_start``,
    ``eos`` (-1: nothing ends a beam), ``row_size``. Per row ``[R]``: its
    ``group``, its group's ``row_first`` and ``row_count``, ``row_eos``,
    ``row_limit`` (the group's ``row_size``). Per next-beam slot
    ``[sum(width)]``: its ``out_group``, its group's ``out_first`` (first
    slot), ``out_row_first`` and ``out_rows``, its ``out_rank`` in the
    group. ``table [6, G]``: the per-group fields, stacked (one gather
    reads them all). The host keeps the layout as ints (``rows``,
    ``widths``) to slice results.
    """

    row_start: torch.Tensor
    num_rows: torch.Tensor
    width: torch.Tensor
    out_start: torch.Tensor
    eos: torch.Tensor
    row_size: torch.Tensor
    group: torch.Tensor
    row_first: torch.Tensor
    row_count: torch.Tensor
    row_eos: torch.Tensor
    row_limit: torch.Tensor
    out_group: torch.Tensor
    out_first: torch.Tensor
    out_row_first: torch.Tensor
    out_rows: torch.Tensor
    out_rank: torch.Tensor
    table: torch.Tensor
    rows: list[int]
    widths: list[int]
    eos_ids: list[int]

    @classmethod
    def of(
        cls,
        rows: Sequence[int],
        widths: Sequence[int],
        eos: Sequence[int],
        row_sizes: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> Segments:
        """Groups of ``rows[g]`` beam slots and ``widths[g]`` next beams."""
        assert rows and all(r > 0 for r in rows), "every group has a row"
        num_rows = np.asarray(rows, dtype=np.int64)
        width = np.asarray(widths, dtype=np.int64)
        row_start = np.cumsum(num_rows) - num_rows
        out_start = np.cumsum(width) - width
        ids = np.arange(len(rows), dtype=np.int64)
        groups = np.stack(
            (row_start, num_rows, width, out_start, np.asarray(eos, dtype=np.int64),
             np.asarray(row_sizes, dtype=np.int64))
        )  # fmt: skip
        per_row = np.repeat(np.stack((ids, *groups[[0, 1, 4, 5]])), num_rows, axis=1)
        per_slot = np.repeat(np.stack((ids, *groups[[3, 0, 1]])), width, axis=1)
        rank = np.arange(per_slot.shape[1]) - per_slot[1]
        flat = np.concatenate((groups.ravel(), per_row.ravel(), per_slot.ravel(), rank))
        table = to_device(flat, torch.device(device))
        num, total_rows, total = len(rows), per_row.shape[1], per_slot.shape[1]
        fields = table.split([num] * 6 + [total_rows] * 5 + [total] * 5)
        return cls(
            *fields, table=table[: 6 * num].view(6, num), rows=list(rows),
            widths=list(widths), eos_ids=list(eos),
        )  # fmt: skip

    @property
    def num_groups(self) -> int:
        return len(self.rows)

    @property
    def total_rows(self) -> int:
        return sum(self.rows)

    @property
    def total_width(self) -> int:
        return sum(self.widths)

    def row_slices(self) -> list[slice]:
        starts = _host_starts(self.rows)
        return [slice(s, s + n) for s, n in zip(starts, self.rows, strict=True)]

    def out_slices(self) -> list[slice]:
        starts = _host_starts(self.widths)
        return [slice(s, s + n) for s, n in zip(starts, self.widths, strict=True)]


cached_layout = functools.lru_cache(maxsize=256)(Segments.of)
""":meth:`Segments.of`, one per layout, shared by every step of it (a
batch's groups keep theirs from step to step; arguments as tuples): its
tensors are read, never written, by every function here and in
:mod:`.select`."""


def to_device(
    values: list | np.ndarray, device: torch.device, dtype: torch.dtype = torch.long
) -> torch.Tensor:
    """``values`` on ``device`` without waiting for it (vLLM's pinned,
    non-blocking copy): a plain copy from host memory waits for the stream,
    every launch before it (the forward) included, which async scheduling
    must not."""
    return torch_utils.async_tensor_h2d(values, device, dtype)


def _exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(counts, 0) - counts


def _host_starts(counts: Sequence[int]) -> list[int]:
    starts, total = [], 0
    for count in counts:
        starts.append(total)
        total += count
    return starts


def group_counts(
    seg: Segments, groups: torch.Tensor, flags: torch.Tensor
) -> torch.Tensor:
    """``[G]``: how many of ``flags`` are set in each group (``groups``: the
    group of each flag)."""
    counts = torch.zeros(seg.num_groups, dtype=torch.long, device=groups.device)
    return counts.index_add_(0, groups, flags.long())


def best_per_group(
    seg: Segments,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    logprobs: torch.Tensor,
    valid: torch.Tensor,
    cum: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each group's best ``width`` candidates, in (row, token) order per
    group on input (``rows`` global): score desc, ties in that order
    (stable sorts), valid before invalid. Returns ``[sum(width)]``
    ``(parents, tokens, scores, valid)``; ``parents`` are the group's own
    row indices; slots past a group's candidates are zeros, not valid."""
    scores = cum[rows] + logprobs.double()
    # A valid candidate's score is finite: -inf puts the others last.
    ranked = torch.where(valid, scores, float("-inf"))
    order = torch.sort(-ranked, stable=True).indices
    groups = seg.group[rows]
    order = order[torch.sort(groups[order], stable=True).indices]
    ordered = groups[order]
    counts = group_counts(seg, groups, torch.ones_like(groups))
    rank = torch.arange(len(order), device=rows.device)
    rank -= _exclusive_cumsum(counts)[ordered]
    row_start, _, width, out_start = seg.table[:4, ordered]  # one gather
    take = (rank < width) & valid[order]
    total = seg.total_width
    slot = torch.where(take, out_start + rank, total)  # total: dropped

    def put(values: torch.Tensor) -> torch.Tensor:
        out = values.new_zeros(total + 1)
        return out.scatter_(0, slot, values)[:total]

    local = rows[order] - row_start
    return put(local), put(tokens[order]), put(scores[order]), put(take)


def carriers_per_group(
    seg: Segments, parents: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """Which member carries each next beam, per group (``-1``: none), the
    rule of :func:`vllm_kvreuse.beam.worker.select.carriers` with each
    group's rows as its members."""
    device = parents.device
    rank = seg.out_rank
    total_rows = seg.total_rows
    big = max(seg.widths) + 1
    member = torch.where(valid, seg.out_row_first + parents, total_rows)
    first = torch.full((total_rows + 1,), big, dtype=torch.long, device=device)
    first.scatter_reduce_(0, member, rank, reduce="amin")
    is_first = valid & (first[member] == rank)
    has_child = first[:total_rows] < big
    # Per group, members without a child first (member order): its spares.
    spares = torch.sort(seg.group * 2 + has_child.long(), stable=True).indices
    num_spares = seg.num_rows - group_counts(seg, seg.group, has_child)
    extra = (valid & ~is_first).long()
    before = torch.cumsum(extra, 0) - extra
    nth = before - before[seg.out_first]  # extras before it, in its group
    start = seg.out_row_first
    spare = spares[start + torch.minimum(nth, seg.out_rows - 1)] - start
    carrier = torch.where(
        is_first, parents, torch.where(nth < num_spares[seg.out_group], spare, -1)
    )
    return torch.where(valid, carrier, -1)


def members_per_group(
    seg: Segments,
    carried_by: torch.Tensor,
    alive: torch.Tensor,
    parents: torch.Tensor,
    valid: torch.Tensor,
) -> torch.Tensor:
    """The member (the group's own index) carrying each next beam (-1:
    none). ``carried_by [R]``: the member carrying each current beam slot;
    ``alive [R]``: the slot is a beam. :func:`carriers_per_group`'s slots
    are, per group, the beams' members in beam order, then the members that
    carry no beam, in member order."""
    total_rows = seg.total_rows
    start = seg.row_first
    local = torch.arange(total_rows, device=parents.device) - start
    key = seg.row_count + local  # a member with no beam: after every beam
    target = torch.where(alive, start + carried_by, total_rows)
    key = torch.cat((key, key.new_zeros(1))).scatter_(0, target, local)[:total_rows]
    slot_member = torch.argsort(2 * start + key)  # per group, in its own rows
    slot = carriers_per_group(seg, parents, valid)
    out_start = seg.out_row_first
    member = slot_member[out_start + slot.clamp(min=0)] - out_start
    return torch.where(slot >= 0, member, -1)


def block_pairs(
    seg: Segments,
    per_member: list[int],
    blocks: list[list[list[list[int]]] | None],
    source: torch.Tensor,
    dst_member: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src, dst)`` block ids: for each next-beam slot, its source
    member's private blocks onto its destination member's, every KV-cache
    group, every group of the batch (``per_member[g]`` blocks each, the
    group's ``blocks[kv][member]``)."""
    count = np.asarray(per_member, dtype=np.int64)
    rows, widths = np.asarray(seg.rows), np.asarray(seg.widths)
    # Where each group's members' blocks start in the flat id lists, and
    # for each slot its blocks' count and each block's place among them.
    base = np.cumsum(rows * count) - rows * count
    k = np.repeat(count, widths)
    num = int(k.sum())
    within = np.arange(num) - np.repeat(np.cumsum(k) - k, k)
    host = np.concatenate((k, np.repeat(base, widths), within))
    k_, slot_base, within_ = to_device(host, source.device).split([len(k), len(k), num])
    src_pos = (slot_base + source * k_).repeat_interleave(k_, output_size=num)
    dst_pos = (slot_base + dst_member * k_).repeat_interleave(k_, output_size=num)
    kept = [(b, n) for b, n in zip(blocks, per_member, strict=True) if b and n]
    ids = to_device(
        [[block for b, _ in kept for ids in b[kv] for block in ids]
         for kv in range(len(kept[0][0]))],
        source.device,
    )  # fmt: skip  # [KV-cache groups, blocks]
    return ids[:, src_pos + within_].flatten(), ids[:, dst_pos + within_].flatten()
