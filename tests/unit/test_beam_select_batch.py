"""Many groups selected at once select what each group selects alone.

A step's groups run as one batch (:mod:`vllm_kvreuse.beam.worker.segments`);
each group alone is the rule that ``test_beam_select.py`` checks against
the host's and a brute force. Random batches of groups of mixed widths,
beam counts, EOS rules, dead rows and ties, both selections, catalogs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_kvreuse.beam.catalog.trie import SidCatalog
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


@pytest.mark.parametrize("seed", range(20))
def test_a_batch_of_catalog_groups_selects_what_each_selects_alone(seed: int) -> None:
    rng = np.random.default_rng(700 + seed)
    vocab = int(rng.integers(8, 50))
    span = min(vocab - 3, 6)
    lows = rng.integers(3, vocab - span + 1, size=3)
    items = lows + rng.integers(0, span, size=(int(rng.integers(1, 60)), 3))
    catalog = SidCatalog.from_items(items, vocab, dense_max_entries=(seed % 2) * 10**6)
    groups = random_groups(rng, vocab)
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
