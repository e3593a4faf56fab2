"""Many groups' beam steps as one: groups laid end to end in flat tensors.

A step's groups are selected together (:mod:`.select`), so the number of
tensor operations, and of launches on an accelerator, does not grow with
the number of groups. Group ``g`` owns rows ``row_start[g] ..
row_start[g] + num_rows[g]`` (its beam slots, one per member) and next-beam
slots ``out_start[g] .. out_start[g] + width[g]``. Every function here is
the one-group rule applied to each group independently: nothing of one
group changes another's answer (``tests/unit/test_beam_select.py`` checks a
batch against its groups one at a time).

Fixed shapes throughout (no host sync): the selections run under async
scheduling on CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Segments:
    """The layout of a batch of groups (module docstring).

    Per group ``[G]``: ``row_start``, ``num_rows``, ``width``, ``out_start``,
    ``eos`` (-1: nothing ends a beam), ``row_size``. Per row ``[R]``:
    ``group``. Per next-beam slot ``[sum(width)]``: ``out_group``. The host
    keeps the same layout as ints (``rows``, ``widths``) to slice results.
    """

    group: torch.Tensor
    out_group: torch.Tensor
    row_start: torch.Tensor
    num_rows: torch.Tensor
    width: torch.Tensor
    out_start: torch.Tensor
    eos: torch.Tensor
    row_size: torch.Tensor
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
        table = torch.tensor(
            [list(rows), list(widths), list(eos), list(row_sizes)],
            dtype=torch.long, device=device,
        )  # fmt: skip
        num_rows, width = table[0], table[1]
        ids = torch.arange(len(rows), device=device)
        return cls(
            group=ids.repeat_interleave(num_rows, output_size=sum(rows)),
            out_group=ids.repeat_interleave(width, output_size=sum(widths)),
            row_start=_exclusive_cumsum(num_rows),
            num_rows=num_rows,
            width=width,
            out_start=_exclusive_cumsum(width),
            eos=table[2],
            row_size=table[3],
            rows=list(rows),
            widths=list(widths),
            eos_ids=list(eos),
        )

    @property
    def num_groups(self) -> int:
        return len(self.rows)

    @property
    def total_rows(self) -> int:
        return sum(self.rows)

    @property
    def total_width(self) -> int:
        return sum(self.widths)

    def out_rank(self) -> torch.Tensor:
        """Each next-beam slot's place in its group (0 .. width - 1)."""
        slots = torch.arange(self.total_width, device=self.width.device)
        return slots - self.out_start[self.out_group]

    def row_slices(self) -> list[slice]:
        starts = _host_starts(self.rows)
        return [slice(s, s + n) for s, n in zip(starts, self.rows, strict=True)]

    def out_slices(self) -> list[slice]:
        starts = _host_starts(self.widths)
        return [slice(s, s + n) for s, n in zip(starts, self.widths, strict=True)]


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
    order = torch.sort(-scores, stable=True).indices
    order = order[torch.sort((~valid[order]).to(torch.int8), stable=True).indices]
    groups = seg.group[rows]
    order = order[torch.sort(groups[order], stable=True).indices]
    ordered = groups[order]
    counts = group_counts(seg, groups, torch.ones_like(groups))
    rank = torch.arange(len(order), device=rows.device)
    rank -= _exclusive_cumsum(counts)[ordered]
    take = (rank < seg.width[ordered]) & valid[order]
    total = seg.total_width
    slot = torch.where(take, seg.out_start[ordered] + rank, total)  # total: dropped

    def put(values: torch.Tensor) -> torch.Tensor:
        out = values.new_zeros(total + 1)
        return out.scatter_(0, slot, values)[:total]

    local = rows[order] - seg.row_start[ordered]
    return put(local), put(tokens[order]), put(scores[order]), put(take)


def carriers_per_group(
    seg: Segments, parents: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """Which member carries each next beam, per group (``-1``: none), the
    rule of :func:`vllm_kvreuse.beam.worker.select.carriers` with each
    group's rows as its members."""
    device = parents.device
    rank = seg.out_rank()
    out_group = seg.out_group
    total_rows = seg.total_rows
    big = max(seg.widths) + 1
    member = torch.where(valid, seg.row_start[out_group] + parents, total_rows)
    first = torch.full((total_rows + 1,), big, dtype=torch.long, device=device)
    first.scatter_reduce_(0, member, rank, reduce="amin")
    is_first = valid & (first[member] == rank)
    has_child = first[:total_rows] < big
    # Per group, members without a child first (member order): its spares.
    spares = torch.sort(seg.group * 2 + has_child.long(), stable=True).indices
    num_spares = seg.num_rows - group_counts(seg, seg.group, has_child)
    extra = (valid & ~is_first).long()
    before = torch.cumsum(extra, 0) - extra
    first_slot = seg.out_start.clamp(max=max(seg.total_width - 1, 0))
    nth = before - before[first_slot][out_group]  # extras before it, in its group
    start = seg.row_start[out_group]
    last = seg.num_rows[out_group] - 1
    spare = spares[start + torch.minimum(nth, last)] - start
    carrier = torch.where(
        is_first, parents, torch.where(nth < num_spares[out_group], spare, -1)
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
    start = seg.row_start[seg.group]
    local = torch.arange(total_rows, device=parents.device) - start
    key = seg.num_rows[seg.group] + local  # a member with no beam: after every beam
    target = torch.where(alive, start + carried_by, total_rows)
    key = torch.cat((key, key.new_zeros(1))).scatter_(0, target, local)[:total_rows]
    slot_member = torch.argsort(2 * start + key)  # per group, in its own rows
    slot = carriers_per_group(seg, parents, valid)
    out_start = seg.row_start[seg.out_group]
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
    device = source.device
    count = torch.tensor(per_member, device=device)
    # Where each group's members' blocks start in the flat id lists.
    base = torch.cumsum(seg.num_rows * count, 0) - seg.num_rows * count
    num = sum(w * k for w, k in zip(seg.widths, per_member, strict=True))
    k = count[seg.out_group]
    first = torch.cumsum(k, 0) - k
    within = torch.arange(num, device=device)
    within -= first.repeat_interleave(k, output_size=num)
    slot_base = base[seg.out_group]
    src_pos = (slot_base + source * k).repeat_interleave(k, output_size=num) + within
    dst_pos = (slot_base + dst_member * k).repeat_interleave(k, output_size=num)
    dst_pos += within
    num_kv = max(len(b) for b, n in zip(blocks, per_member, strict=True) if b and n)
    srcs, dsts = [], []
    for kv in range(num_kv):
        flat = [
            block
            for b, n in zip(blocks, per_member, strict=True)
            if b and n
            for ids in b[kv]
            for block in ids
        ]
        ids = torch.tensor(flat, dtype=torch.long, device=device)
        srcs.append(ids[src_pos])
        dsts.append(ids[dst_pos])
    return torch.cat(srcs), torch.cat(dsts)
