"""One step of catalog-constrained beams inside the engine.

Each beam's request returns its top log-probs *after* the catalog mask
(:mod:`.processor`), so its row already holds its trie node's best
children with their true log-probs, plus the mask's sink and the sampled
token. The step keeps each beam's legal candidates (its node's children; at
a leaf, EOS unless the request ignores it), best ``row_size`` first, ties
to the lower token id, and applies :func:`~vllm_kvreuse.beam.rule.expand`.
This is the rule of the dense reference
(:mod:`vllm_kvreuse.testing.catalog_reference`, tested against a
brute-force search), fed by sparse rows instead of full-vocabulary ones.

A beam with no legal candidate ends: at a leaf it completes as it is
(finish reason "length": it holds a whole item); elsewhere it is dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from vllm.entrypoints.generate.beam_search.utils import BeamSearchSequence

from vllm_kvreuse.beam.catalog.trie import SidCatalog
from vllm_kvreuse.beam.rule import Beam, BeamConfig, Row, Step, expand
from vllm_kvreuse.core.request_keys import SID_EOS, SID_NODE


@dataclass(slots=True)
class CatalogStep:
    """``expand``'s result plus each next beam's trie node."""

    step: Step
    nodes: list[int]  # aligned with step.beams


def legal_rows(
    catalog: SidCatalog,
    beams: Sequence[Beam],
    rows: Sequence[Row | Mapping[int, float]],
    config: BeamConfig,
) -> list[Row]:
    """Each beam's legal candidates, best ``config.row_size`` first (ties:
    lower id)."""
    arrays = [row if isinstance(row, Row) else Row.of(row) for row in rows]
    counts = [len(row) for row in arrays]
    if not sum(counts):
        return [Row.of({}) for _ in arrays]
    tokens = np.concatenate([row.tokens for row in arrays])
    values = np.concatenate([row.logprobs for row in arrays])
    owner = torch.from_numpy(np.repeat(np.arange(len(arrays)), counts))
    nodes = torch.tensor([beam.node for beam in beams], dtype=torch.long)[owner]
    nodes, token_ids = nodes.to(catalog.device), torch.from_numpy(tokens)
    legal = (catalog.child(nodes, token_ids.to(catalog.device)) >= 0).cpu()
    if config.eos_token_id is not None and not config.ignore_eos:
        leaf = catalog.is_leaf(nodes).cpu()
        legal |= leaf & (token_ids == config.eos_token_id)
    ok = legal.numpy() & (values > -np.inf)
    limit, start, kept = config.row_size, 0, []
    for count in counts:
        keep = start + np.flatnonzero(ok[start : start + count])
        start += count
        order = np.lexsort((tokens[keep], -values[keep]))[:limit]
        kept.append(Row(tokens[keep][order], values[keep][order]))
    return kept


def catalog_step(
    catalog: SidCatalog,
    beams: Sequence[Beam],
    rows: Sequence[Row | Mapping[int, float]],
    config: BeamConfig,
) -> CatalogStep:
    """The next beams of a catalog group from each beam's log-prob row."""
    offered = legal_rows(catalog, beams, rows, config)
    at_leaf = catalog.is_leaf(
        torch.tensor([beam.node for beam in beams], dtype=torch.long).to(catalog.device)
    ).tolist()
    completed: list[BeamSearchSequence] = []
    live: list[tuple[Beam, Row]] = []
    for beam, row, leaf in zip(beams, offered, at_leaf, strict=True):
        if row:
            live.append((beam, row))
        elif leaf:  # a whole item with no EOS to take
            seq = beam.seq
            completed.append(
                BeamSearchSequence(
                    orig_prompt=seq.orig_prompt,
                    tokens=seq.tokens,
                    logprobs=[],
                    cum_logprob=seq.cum_logprob,
                    finish_reason="length",
                )
            )
    step = expand([b for b, _ in live], [r for _, r in live], config)
    step.completed = completed + step.completed
    if not step.beams:
        return CatalogStep(step, [])
    node_of = {beam.request_id: beam.node for beam in beams}
    parents = torch.tensor([node_of[pid] for _, pid in step.beams], dtype=torch.long)
    tokens = torch.tensor([seq.tokens[-1] for seq, _ in step.beams], dtype=torch.long)
    nodes = catalog.child(parents.to(catalog.device), tokens.to(catalog.device))
    assert bool((nodes >= 0).all()), "a live catalog beam left the catalog"
    return CatalogStep(step, nodes.tolist())


def catalog_args(
    catalog: SidCatalog | None, config: BeamConfig, nodes: list[int]
) -> list[dict[str, int]]:
    """What the logits processor needs to mask each next beam's row: its
    trie node and, at a whole item, the EOS it may take."""
    assert catalog is not None
    eos = config.eos_token_id
    if eos is None or config.ignore_eos:
        return [{SID_NODE: node} for node in nodes]
    leaves = catalog.is_leaf(torch.tensor(nodes, dtype=torch.long)).tolist()
    return [
        {SID_NODE: node, SID_EOS: eos} if leaf else {SID_NODE: node}
        for node, leaf in zip(nodes, leaves, strict=True)
    ]
