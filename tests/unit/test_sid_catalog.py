"""SID catalog trie and the constrained beam step, against plain-Python oracles."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm.entrypoints.generate.beam_search.utils import BeamSearchSequence

from vllm_kvreuse.beam.catalog.trie import SidCatalog
from vllm_kvreuse.beam.rule import Beam, BeamConfig, expand
from vllm_kvreuse.testing.catalog_reference import (
    expand_constrained,
    offer_rows,
    step,
    top_k_stable,
)

EOS = 0


def random_items(
    rng: np.random.Generator, num: int, depth: int, vocab: int, span: int
) -> np.ndarray:
    """Items whose level-d tokens come from a random window of ``span`` ids
    (windows of different levels may overlap); token 0 (EOS) never used."""
    lows = rng.integers(1, vocab - span + 1, size=depth)
    return lows + rng.integers(0, span, size=(num, depth))


def prefix_children(items: np.ndarray) -> dict[tuple[int, ...], set[int]]:
    """The oracle trie: prefix -> its allowed next tokens (leaves map to {})."""
    children: dict[tuple[int, ...], set[int]] = {}
    for item in map(tuple, items.tolist()):
        for d in range(len(item) + 1):
            children.setdefault(item[:d], set())
            if d < len(item):
                children[item[:d]].add(item[d])
    return children


def walk(catalog: SidCatalog, prefix: tuple[int, ...]) -> int:
    node = 0
    for token in prefix:
        node = int(catalog.child(torch.tensor([node]), torch.tensor([token]))[0])
    return node


def row_pairs(tokens: torch.Tensor, children: torch.Tensor) -> list[list[tuple]]:
    """``legal``'s output per row as (token, child) pairs, holes dropped."""
    return [
        [(t, c) for t, c in zip(ts, cs, strict=True) if t >= 0]
        for ts, cs in zip(tokens.tolist(), children.tolist(), strict=True)
    ]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dense", [0, 1 << 30])
def test_trie_matches_the_prefix_sets(seed: int, dense: int) -> None:
    """Every node's legal tokens are its prefix's continuations, in order."""
    rng = np.random.default_rng(seed)
    depth = int(rng.integers(1, 5))
    items = random_items(rng, int(rng.integers(1, 60)), depth, 40, 6)
    catalog = SidCatalog.from_items(items, 40, dense_max_entries=dense)
    oracle = prefix_children(items)
    assert catalog.num_items == len({tuple(i) for i in items.tolist()})
    assert catalog.num_nodes == len(oracle)
    assert catalog.items().tolist() == sorted(map(list, {*map(tuple, items.tolist())}))
    for prefix, allowed in oracle.items():
        node = walk(catalog, prefix)
        tokens, children = catalog.legal(torch.tensor([node]))
        pairs = row_pairs(tokens, children)[0]
        assert [t for t, _ in pairs] == sorted(allowed), f"node of {prefix}"
        assert [c for _, c in pairs] == [walk(catalog, (*prefix, t)) for t, _ in pairs]
        assert bool(catalog.is_leaf(torch.tensor([node]))) == (len(prefix) == depth)
        assert int(catalog.level_of(torch.tensor([node]))) == len(prefix)


@pytest.mark.parametrize("seed", range(30))
def test_dense_and_csr_give_the_same_answers(seed: int) -> None:
    """Random catalogs, nodes of mixed levels: every lookup agrees."""
    rng = np.random.default_rng(100 + seed)
    vocab = int(rng.integers(8, 300))
    depth = int(rng.integers(1, 5))
    span = int(rng.integers(1, min(vocab - 1, 50) + 1))
    items = random_items(rng, int(rng.integers(1, 400)), depth, vocab, span)
    csr = SidCatalog.from_items(items, vocab, dense_max_entries=0)
    dense = SidCatalog.from_items(items, vocab, dense_max_entries=1 << 30)
    assert csr.dense == {} and sorted(dense.dense) == list(range(depth))
    nodes = torch.from_numpy(rng.integers(0, csr.num_nodes, size=64))
    pairs = row_pairs(*csr.legal(nodes))
    assert pairs == row_pairs(*dense.legal(nodes))
    assert torch.equal(csr.allowed_mask(nodes), dense.allowed_mask(nodes))
    assert all(
        csr.allowed_mask(nodes)[b].nonzero().flatten().tolist() == [t for t, _ in row]
        for b, row in enumerate(pairs)
    )
    logprobs = torch.log_softmax(torch.randn(64, vocab), dim=-1)
    masked = csr.mask_logprobs(logprobs, nodes)
    assert torch.equal(masked, dense.mask_logprobs(logprobs, nodes))
    assert torch.equal(masked.isfinite(), csr.allowed_mask(nodes))
    scratch = logprobs.clone()
    assert dense.mask_logprobs(scratch, nodes, inplace=True) is scratch
    assert torch.equal(scratch, masked)
    tokens = torch.from_numpy(rng.integers(-2, vocab + 2, size=64))
    children = csr.child(nodes, tokens)
    assert torch.equal(children, dense.child(nodes, tokens))
    expected = [
        dict(row).get(t, -1) for row, t in zip(pairs, tokens.tolist(), strict=True)
    ]
    assert children.tolist() == expected
    config = BeamConfig(
        width=int(rng.integers(1, 9)), max_tokens=depth, eos_token_id=EOS
    )
    cum = rng.standard_normal(64)
    a, b = (
        step(csr, logprobs, cum, nodes, config),
        step(dense, logprobs, cum, nodes, config),
    )
    for field in a.__slots__:
        assert np.array_equal(getattr(a, field), getattr(b, field)), field


@pytest.mark.parametrize("seed", range(30))
def test_known_levels_give_the_same_rows(seed: int) -> None:
    """Nodes at levels the caller names (a worker's groups, each at one
    level): the same children as read off the nodes, in rows each level's
    widest node sizes (fixed shapes: the host never waits); dense levels,
    CSR ones, and a mix."""
    rng = np.random.default_rng(300 + seed)
    vocab = int(rng.integers(8, 300))
    depth = int(rng.integers(1, 5))
    span = int(rng.integers(1, min(vocab - 1, 50) + 1))
    items = random_items(rng, int(rng.integers(1, 400)), depth, vocab, span)
    dense_max = int(rng.choice([0, 200, 1 << 30]))
    catalog = SidCatalog.from_items(items, vocab, dense_max_entries=dense_max)
    levels = sorted({int(x) for x in rng.integers(0, depth + 1, size=2)})
    starts = catalog.level_starts.tolist()
    nodes = torch.from_numpy(
        np.concatenate([rng.integers(starts[d], starts[d + 1], size=8) for d in levels])
    )
    assert {catalog.level_at(int(n)) for n in nodes} == set(levels)
    tokens, children = catalog.legal(nodes, levels)
    assert row_pairs(tokens, children) == row_pairs(*catalog.legal(nodes))
    widest = max(
        catalog.dense[d].table.shape[1] if d in catalog.dense
        else int(catalog.indptr.diff()[starts[d]:starts[d + 1]].max())
        for d in levels
    )  # fmt: skip
    assert tokens.shape == children.shape == (len(nodes), widest)


def test_child_is_minus_one_outside_the_catalog() -> None:
    catalog = SidCatalog.from_items(np.array([[3, 5], [4, 6]]), 10)
    nodes = torch.tensor([0, 0, 0, 0, 1, 3])  # node 1 = (3,), node 3 = (3, 5)
    tokens = torch.tensor([3, 5, -1, 13, 5, 5])
    assert catalog.child(nodes, tokens).tolist() == [1, -1, -1, -1, 3, -1]


@pytest.mark.parametrize("seed", range(10))
def test_top_k_stable_is_a_stable_sort_cut_to_k(seed: int) -> None:
    """Ties (and -inf) everywhere: same as a stable descending sort."""
    rng = np.random.default_rng(seed)
    values = torch.from_numpy(rng.integers(-3, 3, size=(16, 40)).astype(np.float32))
    values[values == -3] = float("-inf")
    for k in (0, 1, 5, 39, 40):
        expected = values.sort(dim=1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(top_k_stable(values, k), expected), k


def beams_at(
    rng: np.random.Generator, catalog: SidCatalog, num: int
) -> tuple[list[Beam], list[int]]:
    """``num`` beams on random nodes (mixed depths, leaves included)."""
    nodes = rng.integers(0, catalog.num_nodes, size=num).tolist()
    cums = rng.integers(-4, 0, size=num).astype(float).tolist()
    beams = [
        Beam(BeamSearchSequence(None, [7, i], [], cum_logprob=cum), f"beam{i}")
        for i, cum in enumerate(cums)
    ]
    return beams, nodes


@pytest.mark.parametrize("seed", range(20))
def test_step_is_policy_expand_on_the_masked_rows(seed: int) -> None:
    """The vectorised step selects exactly what ``policy.expand`` selects from
    the masked top-2w rows: same sequences, scores, parents and order, even
    with ties everywhere (coarse log-probs and cumulative scores)."""
    rng = np.random.default_rng(200 + seed)
    vocab = int(rng.integers(8, 60))
    items = random_items(rng, int(rng.integers(1, 80)), 3, vocab, min(vocab - 1, 7))
    catalog = SidCatalog.from_items(
        items, vocab, dense_max_entries=int(seed % 2) * 10**6
    )
    beams, nodes = beams_at(rng, catalog, int(rng.integers(1, 12)))
    logprobs = torch.from_numpy(rng.integers(-6, 0, size=(len(beams), vocab)) / 2.0)
    config = BeamConfig(
        width=int(rng.integers(1, 6)), max_tokens=5, eos_token_id=EOS,
        include_stop_str_in_output=bool(seed % 3 == 0),
    )  # fmt: skip
    ours = expand_constrained(beams, nodes, logprobs.float(), catalog, config)
    theirs = expand(beams, offer_rows(catalog, logprobs.float(), nodes, config), config)
    as_tuples = lambda seqs: [  # noqa: E731
        (s.tokens, s.cum_logprob, s.finish_reason, s.stop_reason) for s in seqs
    ]
    assert as_tuples(ours.step.completed) == as_tuples(theirs.completed)
    assert [(as_tuples([s]), p) for s, p in ours.step.beams] == [
        (as_tuples([s]), p) for s, p in theirs.beams
    ]
    parent_node = {
        beam.request_id: node for beam, node in zip(beams, nodes, strict=True)
    }
    assert ours.nodes == [
        walk_from(catalog, parent_node[p], s.tokens[-1]) for s, p in ours.step.beams
    ]


def walk_from(catalog: SidCatalog, node: int, token: int) -> int:
    return int(catalog.child(torch.tensor([node]), torch.tensor([token]))[0])


def test_a_child_below_the_unmasked_top_k_is_still_found() -> None:
    """Mask before top-k: the catalog's only continuation ranks last in the
    open vocabulary, far outside the top 2w, and is still the next beam."""
    vocab = 50
    catalog = SidCatalog.from_items(np.array([[49]]), vocab)
    logprobs = torch.log_softmax(-torch.arange(vocab, dtype=torch.float32), dim=-1)
    config = BeamConfig(width=2, max_tokens=1, eos_token_id=EOS)
    assert 49 not in logprobs.topk(2 * config.width + 1).indices.tolist()
    result = step(catalog, logprobs[None], [0.0], torch.tensor([0]), config)
    assert result.tokens.tolist() == [49]
    assert result.cum_logprobs.tolist() == [float(logprobs[49])]


def test_fewer_children_than_width_gives_fewer_beams() -> None:
    """Width 3. The root has 2 children, so step 1 yields 2 beams. At step 2,
    (1,) has 3 children and (2,) one: the best 3 of all 4 legal candidates
    live on, so (1,)'s children fill the room (2,) leaves."""
    items = np.array([[1, 5], [1, 6], [1, 7], [2, 5]])
    catalog = SidCatalog.from_items(items, 10)
    config = BeamConfig(width=3, max_tokens=2, eos_token_id=EOS)
    logprobs = torch.log_softmax(torch.tensor([[0.0, 2.0, 1.0] + [0.0] * 7]), -1)
    first = step(catalog, logprobs, [0.0], torch.tensor([0]), config)
    assert first.tokens.tolist() == [1, 2]  # fewer than width: all legal ones
    rows = torch.log_softmax(torch.tensor([[0.0] * 5 + [3.0, 2.0, 1.0, 0, 0]] * 2), -1)
    second = step(catalog, rows, [0.0, -0.1], torch.from_numpy(first.nodes), config)
    # Beam (1,) offers 5, 6, 7; beam (2,) offers 5; best 3 of the 4 by score.
    assert list(zip(second.parents.tolist(), second.tokens.tolist(), strict=True)) == [
        (0, 5), (1, 5), (0, 6),
    ]  # fmt: skip


def test_a_leaf_without_eos_completes_as_it_is() -> None:
    catalog = SidCatalog.from_items(np.array([[1, 2]]), 5)
    leaf = walk(catalog, (1, 2))
    beams = [Beam(BeamSearchSequence(None, [9, 1, 2], [], cum_logprob=-1.5), "a")]
    logprobs = torch.zeros(1, 5)
    for config in (
        BeamConfig(width=2, max_tokens=4, eos_token_id=EOS, ignore_eos=True),
        BeamConfig(width=2, max_tokens=4, eos_token_id=None),
    ):
        out = expand_constrained(beams, [leaf], logprobs, catalog, config)
        assert out.step.beams == []
        [done] = out.step.completed
        assert (done.tokens, done.cum_logprob, done.finish_reason) == (
            [9, 1, 2], -1.5, "length",
        )  # fmt: skip
    with_eos = BeamConfig(width=2, max_tokens=4, eos_token_id=EOS)
    [done] = expand_constrained(
        beams, [leaf], logprobs, catalog, with_eos
    ).step.completed
    assert (done.finish_reason, done.stop_reason) == ("stop", EOS)
    logprobs[0, EOS] = float("-inf")  # the model rules EOS out: still an item
    out = expand_constrained(beams, [leaf], logprobs, catalog, with_eos)
    assert [(s.tokens, s.finish_reason) for s in out.step.completed] == [
        ([9, 1, 2], "length")
    ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seed", range(5))
def test_cuda_gives_what_cpu_gives(seed: int) -> None:
    rng = np.random.default_rng(500 + seed)
    items = random_items(rng, 3000, 3, 5000, 300)
    cpu = SidCatalog.from_items(items, 5000, dense_max_entries=(seed % 2) << 20)
    cuda = cpu.to("cuda")
    nodes = torch.from_numpy(rng.integers(0, cpu.num_nodes, size=256))
    logprobs = torch.log_softmax(torch.randn(256, 5000), dim=-1)
    for a, b in zip(cpu.legal(nodes), cuda.legal(nodes.cuda()), strict=True):
        assert torch.equal(a, b.cpu())
    masked = cpu.mask_logprobs(logprobs, nodes)
    assert torch.equal(masked, cuda.mask_logprobs(logprobs.cuda(), nodes.cuda()).cpu())
    config = BeamConfig(width=64, max_tokens=3, eos_token_id=EOS)
    cum = rng.standard_normal(256)
    ours = step(cpu, logprobs, cum, nodes, config)
    theirs = step(cuda, logprobs.cuda(), cum, nodes.cuda(), config)
    for field in ours.__slots__:
        assert np.array_equal(getattr(ours, field), getattr(theirs, field)), field
