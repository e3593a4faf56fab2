"""The catalog-constrained beam search against brute force, exactly in float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm.entrypoints.generate.beam_search.utils import BeamSearchSequence

from tests.unit.test_sid_catalog import EOS, random_items
from vllm_kvreuse.beam.catalog.trie import SidCatalog
from vllm_kvreuse.beam.rule import Beam, BeamConfig, best, expand, logprob_row
from vllm_kvreuse.testing.catalog_reference import expand_constrained


def table(seed: int, prefix: tuple[int, ...], vocab: int) -> np.ndarray:
    """float32 log-probs of the token after ``prefix``: a fixed random
    function of the prefix, so the search is a real search."""
    rng = np.random.default_rng([seed, len(prefix), *prefix])
    logits = torch.from_numpy(rng.standard_normal(vocab).astype(np.float32) * 3)
    return torch.log_softmax(logits, dim=-1).numpy()


PROMPT = [11, 12, 13]


def constrained_search(
    catalog: SidCatalog, config: BeamConfig, seed: int
) -> tuple[list[list[tuple]], list[BeamSearchSequence]]:
    """Our search, step by step as the scheduler runs it: (live beams after
    each step as (generated tokens, cum), final best beams)."""
    root = BeamSearchSequence(orig_prompt=None, tokens=list(PROMPT), logprobs=[])
    beams, nodes, completed, trace = [Beam(root, "root")], [0], [], []
    live: list[BeamSearchSequence] = []
    for i in range(config.max_tokens):
        rows = [
            table(seed, tuple(b.seq.tokens[len(PROMPT) :]), catalog.vocab_size)
            for b in beams
        ]
        out = expand_constrained(
            beams, nodes, torch.from_numpy(np.stack(rows)), catalog, config
        )
        completed += out.step.completed
        live = [seq for seq, _ in out.step.beams]
        trace.append([(s.tokens[len(PROMPT) :], s.cum_logprob) for s in live])
        if not live:
            break
        beams = [Beam(seq, f"{i}-{j}") for j, seq in enumerate(live)]
        nodes = out.nodes
    return trace, best(completed, live, config)


def brute_force_search(
    items: np.ndarray, vocab: int, config: BeamConfig, seed: int
) -> tuple[list[list[tuple]], list[BeamSearchSequence]]:
    """The naive search: at each step every beam tries every vocabulary
    token, keeps those that extend a catalog prefix, and the best ``width``
    of all of them live on; a complete item can only take EOS."""
    whole = {tuple(item) for item in items.tolist()}
    prefixes = {item[:d] for item in whole for d in range(len(item) + 1)}
    beams: list[tuple[tuple[int, ...], float]] = [((), 0.0)]
    completed, trace = [], []
    for _ in range(config.max_tokens):
        candidates = []
        for prefix, cum in beams:
            row = table(seed, prefix, vocab)
            if prefix in whole:
                done = BeamSearchSequence(
                    orig_prompt=None, tokens=[*PROMPT, *prefix], logprobs=[],
                    cum_logprob=cum + float(row[EOS]), finish_reason="stop",
                    stop_reason=EOS,
                )  # fmt: skip
                completed.append(done)
                continue
            for token in range(vocab):
                if (*prefix, token) in prefixes:
                    candidates.append(((*prefix, token), cum + float(row[token])))
        beams = sorted(candidates, key=lambda c: -c[1])[: config.width]
        trace.append([(list(p), c) for p, c in beams])
        if not beams:
            break
    live = [
        BeamSearchSequence(
            orig_prompt=None, tokens=[*PROMPT, *p], logprobs=[], cum_logprob=c
        )
        for p, c in beams
    ]
    return trace, best(completed, live, config)


def summary(seqs: list[BeamSearchSequence]) -> list[tuple]:
    return [(s.tokens, s.cum_logprob, s.finish_reason) for s in seqs]


@pytest.mark.parametrize("seed", range(40))
def test_search_equals_brute_force_exactly(seed: int) -> None:
    """Float32 prefix-dependent log-prob tables on a tiny vocabulary: every
    step's beams and the final beams equal the naive search's, compared
    with ``==`` (same float32 log-probs, same float64 sums)."""
    rng = np.random.default_rng(300 + seed)
    vocab = int(rng.integers(4, 16))
    depth = int(rng.integers(1, 4))
    items = random_items(rng, int(rng.integers(1, 40)), depth, vocab, vocab - 1)
    catalog = SidCatalog.from_items(items, vocab, dense_max_entries=(seed % 2) * 10**6)
    config = BeamConfig(
        width=int(rng.integers(1, 7)),
        max_tokens=depth + int(rng.integers(0, 2)),  # + 1: leaves take EOS
        eos_token_id=EOS,
        length_penalty=float(rng.choice([0.0, 1.0])),
    )
    ours, ours_best = constrained_search(catalog, config, seed)
    theirs, theirs_best = brute_force_search(items, vocab, config, seed)
    assert ours == theirs
    assert summary(ours_best) == summary(theirs_best)
    assert all(
        tuple(s.tokens[len(PROMPT) :]) in {*map(tuple, items.tolist())}
        for s in ours_best
    )


@pytest.mark.parametrize("seed", range(10))
def test_a_search_as_wide_as_the_catalog_ranks_every_item(seed: int) -> None:
    """With width >= items nothing is pruned: the result is every item, by
    its total log-prob (summed in token order, as the search sums)."""
    rng = np.random.default_rng(400 + seed)
    items = random_items(rng, 12, 3, 10, 9)
    catalog = SidCatalog.from_items(items, 10)
    config = BeamConfig(width=catalog.num_items, max_tokens=3, eos_token_id=EOS)
    _, result = constrained_search(catalog, config, seed)
    scores = {}
    for item in map(tuple, catalog.items().tolist()):
        cum = 0.0
        for d in range(3):
            cum += float(table(seed, item[:d], 10)[item[d]])
        scores[item] = cum
    ranked = sorted(scores.items(), key=lambda kv: -kv[1])
    assert [(tuple(s.tokens[len(PROMPT) :]), s.cum_logprob) for s in result] == ranked


def test_open_vocabulary_misses_the_catalog_the_constrained_search_does_not() -> None:
    """Random log-probs over 2,000 tokens, 64 items: unconstrained beams land
    outside the catalog, constrained ones are all catalog items."""
    vocab, seed = 2000, 7
    rng = np.random.default_rng(seed)
    items = 1000 + np.stack([rng.integers(0, 8, 64) + 8 * d for d in range(3)], axis=1)
    catalog = SidCatalog.from_items(items, vocab)
    config = BeamConfig(width=8, max_tokens=3, eos_token_id=EOS)
    _, constrained = constrained_search(catalog, config, seed)
    in_catalog = {*map(tuple, items.tolist())}
    assert len(constrained) == 8
    assert all(tuple(s.tokens[len(PROMPT) :]) in in_catalog for s in constrained)
    beams = [Beam(BeamSearchSequence(None, list(PROMPT), []), "root")]
    for _ in range(3):
        rows = []
        for b in beams:
            row = torch.from_numpy(
                table(seed, tuple(b.seq.tokens[len(PROMPT) :]), vocab)
            )
            top = row.topk(config.num_logprobs + 1)
            rows.append(
                logprob_row(
                    top.indices.tolist(), top.values.tolist(), config.num_logprobs
                )
            )
        beams = [Beam(s, p) for s, p in expand(beams, rows, config).beams]
    assert not any(tuple(b.seq.tokens[len(PROMPT) :]) in in_catalog for b in beams)
