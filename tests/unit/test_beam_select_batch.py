"""Many groups selected at once select what each group selects alone.

A step's groups run as one batch (:mod:`vllm_kvreuse.beam.worker.segments`);
each group alone is the rule that ``test_beam_select.py`` checks against
the host's and a brute force. Random batches of groups of mixed widths,
beam counts, EOS rules, dead rows and ties, both selections, catalogs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.unit.test_beam_select import random_catalog
from vllm_kvreuse.beam.plan import GroupStep
from vllm_kvreuse.beam.worker.job import BeamJob
from vllm_kvreuse.beam.worker.segments import Segments, members_per_group
from vllm_kvreuse.beam.worker.select import (
    Rule,
    Selection,
    logprobs_of,
    select_catalog,
    select_catalog_rows,
    select_plain,
    select_rows,
)
from vllm_kvreuse.testing.row_passes import RowPasses

EOS = 2


def random_groups(rng: np.random.Generator, vocab: int) -> list[tuple]:
    """Groups of one batch: (logits, cum, rule, alive, sampled, carried_by)."""
    groups = []
    levels = int(rng.choice([3, 6, 1000]))
    for _ in range(int(rng.integers(1, 6))):
        width = int(rng.choice([1, 2, 3, 5, 8, 16]))
        rows = int(rng.integers(1, width + 1))
        logits = torch.from_numpy(rng.integers(0, levels, size=(rows, vocab)) / 4.0)
        cum = torch.from_numpy(rng.choice([0.0, -1.0, -1.5, -2.25], size=rows))
        alive = torch.from_numpy(rng.random(rows) < 0.8)
        alive[0] = True
        ends = bool(rng.integers(0, 2))
        rule = Rule(width, EOS if ends else -1, 2 * width if ends else width)
        sampled = torch.from_numpy(rng.integers(0, vocab, size=rows))
        carried_by = torch.from_numpy(rng.permutation(rows))
        groups.append((logits.float(), cum, rule, alive, sampled, carried_by))
    return groups


def segments_of(groups: list[tuple]) -> Segments:
    rules = [g[2] for g in groups]
    return Segments.of(
        [len(g[1]) for g in groups], [r.width for r in rules],
        [r.eos for r in rules], [r.row_size for r in rules],
    )  # fmt: skip


def part(sel: Selection, out: slice, rows: slice) -> list[list]:
    return [
        sel.parents[out].tolist(), sel.tokens[out].tolist(),
        sel.scores[out].tolist(), sel.valid[out].tolist(),
        sel.eos_done[rows].tolist(), sel.leaf_done[rows].tolist(),
        sel.eos_scores[rows][sel.eos_done[rows]].tolist(),
    ]  # fmt: skip


def cat(groups: list[tuple], i: int) -> torch.Tensor:
    return torch.cat([g[i] for g in groups])


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "pruned"])
@pytest.mark.parametrize("seed", range(40))
def test_a_batch_selects_what_each_group_selects_alone(seed: int, fixed: bool) -> None:
    rng = np.random.default_rng(900 + seed)
    groups = random_groups(rng, int(rng.choice([12, 40, 128, 300])))
    seg = segments_of(groups)
    sel = select_rows(
        logprobs_of(cat(groups, 0)), cat(groups, 1), seg, sampled=cat(groups, 4),
        fixed=fixed, alive=cat(groups, 3),
    )  # fmt: skip
    members = members_per_group(
        seg, cat(groups, 5), cat(groups, 3), sel.parents, sel.valid
    )
    for g, out, rows in zip(groups, seg.out_slices(), seg.row_slices(), strict=True):
        logits, cum, rule, alive, sampled, carried_by = g
        alone = select_plain(
            logits, cum, rule, sampled=sampled, fixed=fixed, alive=alive
        )
        assert part(sel, out, rows) == part(alone, slice(None), slice(None))
        one = Segments.of([len(cum)], [rule.width], [rule.eos], [rule.row_size])
        want = members_per_group(one, carried_by, alive, alone.parents, alone.valid)
        assert members[out].tolist() == want.tolist()


@pytest.mark.parametrize("seed", range(6))
def test_a_step_never_writes_its_layout(seed: int) -> None:
    """Steps of the same layout share one :class:`Segments` (the
    segments module's ``cached_layout``): no selection may write its
    tensors."""
    rng = np.random.default_rng(500 + seed)
    catalog = random_catalog(rng, dense=bool(seed % 2))
    groups = random_groups(rng, catalog.vocab_size)
    seg = segments_of(groups)
    fields = [
        f for f in Segments.__slots__ if isinstance(getattr(seg, f), torch.Tensor)
    ]
    before = {f: getattr(seg, f).clone() for f in fields}
    for fixed in (True, False):
        sel = select_rows(
            logprobs_of(cat(groups, 0)), cat(groups, 1), seg, sampled=cat(groups, 4),
            fixed=fixed, alive=cat(groups, 3),
        )  # fmt: skip
        members_per_group(seg, cat(groups, 5), cat(groups, 3), sel.parents, sel.valid)
    nodes = torch.from_numpy(rng.integers(0, catalog.num_nodes, size=seg.total_rows))
    children, _ = catalog.legal(nodes)
    select_catalog_rows(
        logprobs_of(cat(groups, 0)), cat(groups, 1), seg, children,
        catalog.is_leaf(nodes), alive=cat(groups, 3),
    )  # fmt: skip
    for f in fields:
        assert torch.equal(getattr(seg, f), before[f]), f"a step wrote seg.{f}"


def _held(groups: list[tuple], seg: Segments) -> tuple[torch.Tensor, torch.Tensor]:
    """The groups' log-prob rows in member order (each group's beam ``b``
    held by its member ``carried_by[b]``), and ``order``: the row holding
    each beam."""
    order = torch.cat([g[5] for g in groups]) + seg.row_first
    rows = torch.empty_like(order)
    rows[order] = torch.arange(len(order))
    return logprobs_of(cat(groups, 0))[rows], order


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "pruned"])
@pytest.mark.parametrize("seed", range(20))
def test_rows_in_member_order_select_what_beam_order_selects(
    seed: int, fixed: bool
) -> None:
    """The workers hand over rows as their members hold them (no copy into
    beam order): with ``order`` naming the row of each beam, every result
    is the one of rows in beam order, catalog groups too."""
    rng = np.random.default_rng(300 + seed)
    catalog = random_catalog(rng, dense=bool(seed % 2))
    groups = random_groups(rng, int(rng.choice([12, 40, 128, 300])))
    seg = segments_of(groups)
    held, order = _held(groups, seg)
    plain = [cat(groups, 1), seg, cat(groups, 4), fixed, cat(groups, 3)]
    want = select_rows(logprobs_of(cat(groups, 0)), *plain)
    got = select_rows(held, *plain, order=order)
    whole = (slice(None), slice(None))
    assert part(got, *whole) == part(want, *whole)
    groups = random_groups(rng, catalog.vocab_size)
    seg = segments_of(groups)
    held, order = _held(groups, seg)
    nodes = torch.from_numpy(rng.integers(0, catalog.num_nodes, size=len(order)))
    children, _ = catalog.legal(nodes)
    extra = [cat(groups, 1), seg, children, catalog.is_leaf(nodes), cat(groups, 3)]
    want = select_catalog_rows(logprobs_of(cat(groups, 0)), *extra)
    got = select_catalog_rows(held, *extra, order=order)
    assert part(got, *whole) == part(want, *whole)


@pytest.mark.parametrize("seed", range(20))
def test_a_batch_of_catalog_groups_selects_what_each_selects_alone(seed: int) -> None:
    rng = np.random.default_rng(700 + seed)
    catalog = random_catalog(rng, dense=bool(seed % 2))
    groups = random_groups(rng, catalog.vocab_size)
    nodes = [
        torch.from_numpy(rng.integers(0, catalog.num_nodes, size=len(g[1])))
        for g in groups
    ]
    seg = segments_of(groups)
    children, _ = catalog.legal(torch.cat(nodes))
    at_leaf = catalog.is_leaf(torch.cat(nodes))
    sel = select_catalog_rows(
        logprobs_of(cat(groups, 0)),
        cat(groups, 1),
        seg,
        children,
        at_leaf,
        alive=cat(groups, 3),
    )
    for g, n, out, rows in zip(
        groups, nodes, seg.out_slices(), seg.row_slices(), strict=True
    ):
        logits, cum, rule, alive, _, _ = g
        kids, _ = catalog.legal(n)
        alone = select_catalog(logits, cum, rule, kids, catalog.is_leaf(n), alive=alive)
        assert part(sel, out, rows) == part(alone, slice(None), slice(None))


class _Ops(TorchDispatchMode):
    """Counts the tensor operations that compute (views left out): on an
    accelerator, each is a kernel launch or a copy."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


def _step_ops(num_groups: int, width: int = 8, vocab: int = 64) -> int:
    """Tensor operations of a live step of ``num_groups`` groups in a
    worker's :class:`BeamJob` (the groups started the step before)."""
    members = [[f"g{g}-m{i}" for i in range(width)] for g in range(num_groups)]
    row_of = {m: i for i, m in enumerate(m for group in members for m in group)}
    logits = torch.randn(len(row_of), vocab, generator=torch.Generator().manual_seed(0))
    sampled = torch.zeros(len(row_of), dtype=torch.long)
    states: dict = {}

    def blocks(g: int) -> list:
        return [[[100 * g + i] for i in range(width)]]

    def steps(kind: str) -> list[GroupStep]:
        first = {"carriers": list(range(width)), "cum_logprobs": [0.0] * width}
        return [
            GroupStep(f"g{g}", kind, members[g], width=width, blocks=blocks(g),
                      **(first if kind == "start" else {}))
            for g in range(num_groups)
        ]  # fmt: skip

    copied: list[int] = []
    job = BeamJob(steps("start"), states, lambda: None, row_of, lambda s, d: None)
    job.prepare(logits)
    job.finish(sampled.clone())
    job = BeamJob(
        steps("step"), states, lambda: None, row_of, lambda s, d: copied.append(1)
    )
    with _Ops() as ops:
        job.prepare(logits)
        job.finish(sampled.clone())
    assert copied == [1] and len(job.results) == num_groups
    return ops.count


def _job_steps(row_of: dict[str, int], num_rows: int, seed: int) -> list:
    """Two steps (start, then live) of three groups of width 6 through a
    worker's :class:`BeamJob`, members at ``row_of``'s rows of a batch of
    ``num_rows``: each step's packed results and the tokens it wrote."""
    width, vocab = 6, 300
    rng = np.random.default_rng(seed)
    states: dict = {}
    out = []
    for kind in ("start", "step"):
        steps = [
            GroupStep(
                f"g{g}", kind, [f"g{g}-m{i}" for i in range(width)], width=width,
                eos=EOS, row_size=2 * width,
                **({"carriers": list(range(width)), "cum_logprobs": [0.0] * width}
                   if kind == "start" else {}),
            )
            for g in range(3)
        ]  # fmt: skip
        by_member = torch.from_numpy(
            rng.integers(0, 6, size=(len(row_of), vocab)) / 4.0
        )
        logits = torch.zeros(num_rows, vocab)
        for i, member in enumerate(sorted(row_of)):
            logits[row_of[member]] = by_member[i].float()
        sampled = torch.zeros(num_rows, 1, dtype=torch.long)
        job = BeamJob(steps, states, lambda: None, row_of)
        job.prepare(logits)
        job.finish(sampled)
        tokens = [int(sampled[row_of[m]]) for m in sorted(row_of)]
        results = {
            g: (r.next.tolist(), r.beams.tolist()) for g, r in job.results.items()
        }
        out.append((results, tokens))
    return out


def test_members_anywhere_in_the_batch_step_as_members_in_a_row() -> None:
    """Members whose rows lie together are read in place (no copy); members
    spread among other rows are gathered. Both steps give the same beams."""
    members = [f"g{g}-m{i}" for g in range(3) for i in range(6)]
    together = {m: i for i, m in enumerate(members)}
    spread = {m: 3 * i + 1 for i, m in enumerate(reversed(members))}
    for seed in range(5):
        assert _job_steps(together, 18, seed) == _job_steps(spread, 60, seed)


def test_a_step_of_sixteen_groups_runs_the_operations_of_one() -> None:
    """The workers' beam step does not repeat per group: 16 live groups
    cost the tensor operations (launches, on a GPU) of one."""
    assert _step_ops(16) == _step_ops(1)


@pytest.mark.parametrize("eos", [-1, EOS])
def test_the_fixed_step_passes_over_the_rows_four_times(eos: int) -> None:
    """The fixed-shape step (an accelerator's) passes over the ``[R, V]``
    log-probs in a top-k, a compare, a select and a second top-k over
    int32 keys of the ties: 18 bytes an element. EOS adds a copy and its
    rank (one compare, one count): 32. A packed 64-bit key took 186 and
    226 (33 and 38 passes)."""
    groups, width, vocab = 16, 8, 4096
    rows = groups * width
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    logprobs = logprobs_of(logits.bfloat16().float())
    seg = Segments.of(
        [width] * groups, [width] * groups, [eos] * groups,
        [2 * width] * groups, logits.device,
    )  # fmt: skip
    cum = torch.zeros(rows, dtype=torch.float64)
    with RowPasses((rows, vocab)) as passes:
        select_rows(logprobs, cum, seg, fixed=True)
    kernels = ["topk", "eq", "where", "topk"]
    if eos >= 0:
        kernels = ["clone", *kernels, "gt", "sum"]
    assert passes.names == kernels
    assert passes.bytes <= (18 if eos < 0 else 32) * rows * vocab
