"""The beam step next to the logits selects what the host's rule selects.

The device step (:mod:`vllm_kvreuse.beam.worker.select`, both selections) against
a brute force over whole rows, and against ``rule.expand`` /
``catalog_step`` fed the rows vLLM's sampler returns; random cases with
ties everywhere (few distinct logits, equal cumulative scores), EOS ending
beams or not, the sampler's own draw, catalogs, and whole searches ranked
with a length penalty."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm.entrypoints.generate.beam_search.utils import BeamSearchSequence
from vllm.v1.sample.sampler import Sampler

from vllm_kvreuse.beam.catalog.rule import catalog_step
from vllm_kvreuse.beam.catalog.trie import SidCatalog
from vllm_kvreuse.beam.rule import Beam, BeamConfig, best, expand, logprob_row
from vllm_kvreuse.beam.scheduler.live import carriers as host_carriers
from vllm_kvreuse.beam.worker.select import (
    Rule,
    Selection,
    carriers,
    logprobs_of,
    select_catalog,
    select_plain,
)
from vllm_kvreuse.testing.beam_reference import reference_step

EOS = 2


def random_case(rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor, Rule]:
    """Logits with few distinct values (ties in and across rows, at every
    cut), cumulative scores with repeats, EOS ending beams or not."""
    width = int(rng.choice([1, 2, 3, 5, 8, 16]))
    num_beams = int(rng.integers(1, width + 1))
    vocab = int(rng.choice([12, 40, 300]))
    levels = int(rng.choice([3, 6, 1000]))
    logits = torch.from_numpy(rng.integers(0, levels, size=(num_beams, vocab)) / 4.0)
    cum = torch.from_numpy(rng.choice([0.0, -1.0, -1.5, -2.25], size=num_beams))
    ends = bool(rng.integers(0, 2))
    rule = Rule(width, EOS if ends else -1, 2 * width if ends else width)
    return logits.float(), cum, rule


def as_lists(sel: Selection) -> tuple[list, ...]:
    n = int(sel.valid.sum())
    assert bool(sel.valid[:n].all()) and not bool(sel.valid[n:].any())
    done = sel.eos_done.tolist()
    return (
        sel.parents[:n].tolist(),
        sel.tokens[:n].tolist(),
        sel.scores[:n].tolist(),
        done,
        [s for s, d in zip(sel.eos_scores.tolist(), done, strict=True) if d],
        sel.leaf_done.tolist(),
    )


def reference_lists(logits: torch.Tensor, cum: torch.Tensor, rule: Rule, **kw):
    ref = reference_step(
        logprobs_of(logits).numpy(), cum.numpy(), rule.width, rule.eos,
        rule.row_size, **kw,
    )  # fmt: skip
    done = ref.eos_done.tolist()
    return (
        ref.parents.tolist(),
        ref.tokens.tolist(),
        ref.scores.tolist(),
        done,
        [s for s, d in zip(ref.eos_scores.tolist(), done, strict=True) if d],
        ref.leaf_done.tolist(),
    )


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "pruned"])
@pytest.mark.parametrize("seed", range(60))
def test_device_step_is_the_brute_force_rule(seed: int, fixed: bool) -> None:
    """Both selections equal the brute force over whole rows, ties included,
    scores bit for bit; the sampler's draw ends a beam at EOS."""
    rng = np.random.default_rng(seed)
    logits, cum, rule = random_case(rng)
    sampled = torch.from_numpy(rng.integers(0, logits.shape[1], size=len(cum)))
    got = select_plain(logits, cum, rule, sampled=sampled, fixed=fixed)
    assert as_lists(got) == reference_lists(logits, cum, rule, sampled=sampled.numpy())


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "pruned"])
@pytest.mark.parametrize("vocab", [12, 300])
def test_eos_on_top_of_every_row_takes_no_place(vocab: int, fixed: bool) -> None:
    """EOS is each row's best token: it ends every beam, and the next beams
    are the best of the rest. (The pruned path's bound must not count EOS
    among a row's best runs: it would leave no candidate above it.)"""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=generator)
    logits[:, EOS] = 10.0
    cum = torch.tensor([0.0, -0.5, -1.0, -1.5], dtype=torch.float64)
    rule = Rule(3, EOS, 6)
    got = select_plain(logits, cum, rule, fixed=fixed)
    assert bool(got.eos_done.all()) and int(got.valid.sum()) == 3
    assert as_lists(got) == reference_lists(logits, cum, rule)


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "pruned"])
def test_a_tie_with_eos_ranks_by_token_in_a_wide_row(fixed: bool) -> None:
    """Three tokens above EOS and one tied with it: a tie below EOS's id
    ranks ahead of it (EOS falls out of a row of 4), one above does not
    (the pruned path counts only the runs that reach EOS here)."""
    logits = torch.full((2, 1024), -5.0)
    logits[:, [500, 600, 700]] = 5.0
    logits[:, EOS] = 3.0
    logits[0, 1] = logits[1, 5] = 3.0
    cum = torch.zeros(2, dtype=torch.float64)
    rule = Rule(2, EOS, 4)
    got = select_plain(logits, cum, rule, fixed=fixed)
    assert got.eos_done.tolist() == [False, True]
    assert as_lists(got) == reference_lists(logits, cum, rule)


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "pruned"])
@pytest.mark.parametrize("seed", range(30))
def test_bfloat16_logits_select_what_the_brute_force_does(
    seed: int, fixed: bool
) -> None:
    """A bfloat16 model's logits (few mantissa bits: ties everywhere) give
    both selections the brute force's beams, scores bit for bit."""
    rng = np.random.default_rng(5000 + seed)
    rows, vocab = int(rng.integers(1, 9)), int(rng.choice([40, 300, 1024]))
    logits = torch.from_numpy(rng.standard_normal((rows, vocab)) * 3).bfloat16()
    cum = torch.from_numpy(rng.choice([0.0, -1.0, -1.5], size=rows))
    width = int(rng.choice([1, 2, 4, 8]))
    rule = Rule(width, EOS, 2 * width) if seed % 2 else Rule(width)
    got = select_plain(logits, cum, rule, fixed=fixed)
    assert as_lists(got) == reference_lists(logits, cum, rule)


def beams_of(cum: torch.Tensor) -> list[Beam]:
    return [
        Beam(BeamSearchSequence(None, [1, 5 + i], [], cum_logprob=c), f"b{i}")
        for i, c in enumerate(cum.tolist())
    ]


def sampler_rows(logits: torch.Tensor, size: int) -> list:
    """Each row as vLLM's sampler returns it to the host: greedy sampled
    token first, then the top ``size`` raw log-probs."""
    sampler = Sampler()
    lp = sampler.compute_logprobs(logits)
    size = min(size, logits.shape[1])
    out = sampler.gather_logprobs(lp, size, token_ids=lp.argmax(dim=-1))
    return [
        logprob_row(tokens, values, size)
        for tokens, values in zip(
            out.logprob_token_ids.tolist(), out.logprobs.tolist(), strict=True
        )
    ]


def canonical_rows(logits: torch.Tensor, size: int) -> list:
    """Each row's top ``size`` by (log-prob desc, token asc), sampled first."""
    lp = logprobs_of(logits)
    values, tokens = lp.sort(dim=1, descending=True, stable=True)
    return [
        logprob_row([t[0], *t[:size]], [v[0], *v[:size]], size)
        for t, v in zip(tokens.tolist(), values.tolist(), strict=True)
    ]


def cut_is_tied(logits: torch.Tensor, size: int) -> bool:
    """A row's ``size``-th and next log-probs are equal: which of them vLLM's
    top-k returns is up to its kernel."""
    if size >= logits.shape[1]:
        return False
    top = logprobs_of(logits).topk(size + 1, dim=1).values
    return bool((top[:, -1] == top[:, -2]).any())


@pytest.mark.parametrize("rows", ["vllm", "canonical"])
@pytest.mark.parametrize("seed", range(60))
def test_device_step_selects_what_the_host_policy_selects(seed: int, rows: str) -> None:
    """``rule.expand`` on the rows vLLM's real sampler returns (top
    ``row_size`` plus the drawn token) selects the device step's beams,
    scores and completions, ties across beams and within rows included;
    on rows cut in the canonical order, always (with vLLM's rows, a tie at
    the cut is the kernel's pick)."""
    rng = np.random.default_rng(1000 + seed)
    logits, cum, rule = random_case(rng)
    config = BeamConfig(
        width=rule.width, max_tokens=4, eos_token_id=EOS,
        ignore_eos=rule.eos < 0, include_stop_str_in_output=bool(seed % 2),
    )  # fmt: skip
    if rows == "vllm" and cut_is_tied(logits, config.num_logprobs):
        pytest.skip("a tie at the top-k cut: the host row is the kernel's pick")
    make_rows = sampler_rows if rows == "vllm" else canonical_rows
    step = expand(beams_of(cum), make_rows(logits, config.num_logprobs), config)
    greedy = logits.argmax(dim=-1)
    sel = as_lists(select_plain(logits, cum, rule, sampled=greedy))
    parents, tokens, scores, done, done_scores, _ = sel
    assert [(p, s.tokens[-1], s.cum_logprob) for s, p in step.beams] == [
        (f"b{p}", t, s) for p, t, s in zip(parents, tokens, scores, strict=True)
    ]
    assert [s.cum_logprob for s in step.completed] == done_scores
    ended = [i for i, d in enumerate(done) if d]
    assert [s.tokens[:2] for s in step.completed] == [[1, 5 + i] for i in ended]


def test_tie_order_is_beam_then_token() -> None:
    """Equal scores: the lower beam index, then the lower token id."""
    logits = torch.zeros(3, 6)
    cum = torch.zeros(3, dtype=torch.float64)
    for fixed in (True, False):
        sel = select_plain(logits, cum, Rule(4), fixed=fixed)
        assert sel.parents.tolist() == [0, 0, 0, 0]
        assert sel.tokens.tolist() == [0, 1, 2, 3]
    cum = torch.tensor([-1.0, 0.0, 0.0], dtype=torch.float64)
    sel = select_plain(logits, cum, Rule(8))
    assert sel.parents.tolist() == [1] * 6 + [2] * 2


def random_catalog(rng: np.random.Generator, dense: bool) -> SidCatalog:
    """A catalog of up to 59 three-token items over a small vocabulary,
    dense levels or CSR ones."""
    vocab = int(rng.integers(8, 50))
    span = min(vocab - 3, 6)
    lows = rng.integers(3, vocab - span + 1, size=3)
    items = lows + rng.integers(0, span, size=(int(rng.integers(1, 60)), 3))
    return SidCatalog.from_items(items, vocab, dense_max_entries=dense * 10**6)


def catalog_case(seed: int):
    rng = np.random.default_rng(500 + seed)
    catalog = random_catalog(rng, dense=bool(seed % 2))
    vocab = catalog.vocab_size
    num_beams = int(rng.integers(1, 9))
    nodes = torch.from_numpy(rng.integers(0, catalog.num_nodes, size=num_beams))
    logits = torch.from_numpy(rng.integers(0, 5, size=(num_beams, vocab)) / 2.0).float()
    logits[torch.from_numpy(rng.random((num_beams, vocab)) < 0.05)] = float("-inf")
    cum = torch.from_numpy(rng.choice([0.0, -1.0, -2.5], size=num_beams))
    width = int(rng.integers(1, 7))
    ends = bool(seed % 3)
    return catalog, nodes, logits, cum, Rule(width, EOS if ends else -1, 2 * width)


@pytest.mark.parametrize("seed", range(40))
def test_catalog_step_selects_what_the_host_selects(seed: int) -> None:
    """Inside a catalog: the brute force over the trie's legal tokens, and
    the host's ``catalog_step`` on the rows vLLM returns after the catalog
    mask (canonical top ``row_size`` of the legal tokens), agree with it."""
    catalog, nodes, logits, cum, rule = catalog_case(seed)
    children, _ = catalog.legal(nodes)
    at_leaf = catalog.is_leaf(nodes)
    got = as_lists(select_catalog(logits, cum, rule, children, at_leaf))
    legal = catalog.allowed_mask(nodes).numpy()
    if rule.eos >= 0:
        legal[at_leaf.numpy(), EOS] = True
    want = reference_lists(logits, cum, rule, legal=legal, at_leaf=at_leaf.numpy())
    assert got == want
    config = BeamConfig(
        width=rule.width, max_tokens=3, eos_token_id=EOS,
        ignore_eos=rule.eos < 0, sid_catalog=True,
    )  # fmt: skip
    lp = logprobs_of(logits).masked_fill(~torch.from_numpy(legal), float("-inf"))
    values, order = lp.sort(dim=1, descending=True, stable=True)
    rows = [
        {t: v for t, v in zip(ts, vs, strict=True) if v > -np.inf}
        for ts, vs in zip(order.tolist(), values.tolist(), strict=True)
    ]
    beams = [
        Beam(b.seq, b.request_id, int(n))
        for b, n in zip(beams_of(cum), nodes.tolist(), strict=True)
    ]
    host = catalog_step(catalog, beams, rows, config).step
    parents, tokens, scores, eos_done, _, leaf_done = got
    assert [(p, s.tokens[-1], s.cum_logprob) for s, p in host.beams] == [
        (f"b{p}", t, s) for p, t, s in zip(parents, tokens, scores, strict=True)
    ]
    ended = [(i, "stop") for i, d in enumerate(eos_done) if d]
    ended += [(i, "length") for i, d in enumerate(leaf_done) if d]
    assert sorted((int(s.tokens[1]) - 5, s.finish_reason) for s in host.completed) == (
        sorted(ended)
    )


@pytest.mark.parametrize("seed", range(30))
def test_carriers_on_device_are_the_hosts(seed: int) -> None:
    """First child keeps its parent's member, further children take spares
    in order, beyond the spares none: as ``live.carriers``."""
    rng = np.random.default_rng(seed)
    num_members = int(rng.integers(1, 10))
    num_beams = int(rng.integers(1, num_members + 1))
    width = int(rng.integers(1, 12))
    parents = torch.from_numpy(rng.integers(0, num_beams, size=width))
    valid = torch.arange(width) < int(rng.integers(0, width + 1))
    got = carriers(parents, valid, num_members).tolist()
    members = [f"m{i}" for i in range(num_members)]
    picked = zip(parents.tolist(), valid.tolist(), strict=True)
    children = [f"m{p}" for p, v in picked if v]
    rows, spares = host_carriers(members, children)
    spares = spares[::-1]
    want = []
    for row in rows:
        want.append(int(row[1:]) if row else int(spares.pop()[1:]) if spares else -1)
    assert got[: len(want)] == want and got[len(want) :] == [-1] * (width - len(want))


def toy_logits(prefixes: list[list[int]], vocab: int, seed: int) -> torch.Tensor:
    """A deterministic toy model: each prefix's logits from its hash
    (continuous: no ties at a top-k cut, where the host's row would be the
    kernel's pick; the single-step tests cover ties)."""
    rows = []
    for prefix in prefixes:
        gen = np.random.default_rng(hash((seed, *prefix)) % 2**32)
        rows.append(gen.normal(size=vocab) * 2.0)
    return torch.from_numpy(np.array(rows)).float()


@pytest.mark.parametrize("penalty", [0.0, 1.0, 2.0])
@pytest.mark.parametrize("seed", range(8))
def test_whole_searches_end_with_the_same_beams(seed: int, penalty: float) -> None:
    """Several steps with EOS ending beams, final beams ranked with a
    length penalty: the host loop on sampler rows and the device step give
    the same beams, scores and finish reasons."""
    width, vocab = 4, 24
    config = BeamConfig(
        width=width, max_tokens=5, eos_token_id=EOS, length_penalty=penalty
    )
    rule = Rule(width, EOS, config.row_size)
    host = beams_of(torch.zeros(1, dtype=torch.float64))
    dev = list(host)
    host_done: list = []
    dev_done: list = []
    for _ in range(config.max_tokens):
        logits = toy_logits([b.seq.tokens for b in host], vocab, seed)
        step = expand(host, sampler_rows(logits, config.num_logprobs), config)
        host_done += step.completed
        host = [Beam(s, f"b{i}") for i, (s, _) in enumerate(step.beams)]
        logits = toy_logits([b.seq.tokens for b in dev], vocab, seed)
        cum = torch.tensor([b.seq.cum_logprob for b in dev], dtype=torch.float64)
        sel = select_plain(logits, cum, rule, sampled=logits.argmax(dim=-1))
        for i in sel.eos_done.nonzero().flatten().tolist():
            dev_done.append(
                BeamSearchSequence(
                    None, dev[i].seq.tokens, [], cum_logprob=float(sel.eos_scores[i]),
                    finish_reason="stop", stop_reason=EOS,
                )
            )  # fmt: skip
        picked = zip(
            sel.parents.tolist(), sel.tokens.tolist(), sel.scores.tolist(), strict=True
        )
        dev = [
            Beam(
                BeamSearchSequence(None, [*dev[p].seq.tokens, t], [], cum_logprob=s),
                f"b{i}",
            )
            for i, (p, t, s) in enumerate(picked)
        ]
    key = lambda seqs: [(s.tokens, s.cum_logprob, s.finish_reason) for s in seqs]  # noqa: E731
    want = best(host_done, [b.seq for b in host], config)
    assert key(best(dev_done, [b.seq for b in dev], config)) == key(want)
