"""One step of catalog-constrained beams inside the engine.

Each beam's request returns its top log-probs *after* the catalog mask
(:mod:`.catalog_processor`), so its row already holds its trie node's best
children with their true log-probs, plus the mask's sink and the sampled
token. The step keeps each beam's legal candidates (its node's children; at
a leaf, EOS unless the request ignores it), best ``2 * width`` first, ties
to the lower token id, and applies :func:`~vllm_kvreuse.beam.policy.expand`.
This is the rule of :mod:`.catalog_step` (tested against a brute-force
search there), fed by sparse rows instead of full-vocabulary ones.

A beam with no legal candidate ends: at a leaf it completes as it is
(finish reason "length": it holds a whole item); elsewhere it is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from vllm.entrypoints.generate.beam_search.utils import BeamSearchSequence

from vllm_kvreuse.beam.catalog import SidCatalog
from vllm_kvreuse.beam.policy import Beam, BeamConfig, Step, expand


@dataclass(slots=True)
class CatalogStep:
    """``expand``'s result plus each next beam's trie node."""

    step: Step
    nodes: list[int]  # aligned with step.beams


def legal_rows(
    catalog: SidCatalog,
    beams: Sequence[Beam],
    rows: Sequence[dict[int, float]],
    config: BeamConfig,
) -> list[dict[int, float]]:
    """Each beam's legal candidates, best ``2 * width`` first (ties: lower id)."""
    owners = [i for i, row in enumerate(rows) for _ in row]
    if not owners:
        return [{} for _ in rows]
    tokens = torch.tensor([t for row in rows for t in row], dtype=torch.long)
    values = [v for row in rows for v in row.values()]
    nodes = torch.tensor([beams[i].node for i in owners], dtype=torch.long)
    legal = catalog.child(nodes.to(catalog.device), tokens.to(catalog.device)) >= 0
    legal = legal.cpu()
    if config.eos_token_id is not None and not config.ignore_eos:
        leaf = catalog.is_leaf(nodes.to(catalog.device)).cpu()
        legal |= leaf & (tokens == config.eos_token_id)
    kept: list[list[tuple[float, int]]] = [[] for _ in rows]
    for owner, token, value, ok in zip(
        owners, tokens.tolist(), values, legal.tolist(), strict=True
    ):
        if ok and value > float("-inf"):
            kept[owner].append((-value, token))
    limit = 2 * config.width
    return [{t: -v for v, t in sorted(row)[:limit]} for row in kept]


def catalog_step(
    catalog: SidCatalog,
    beams: Sequence[Beam],
    rows: Sequence[dict[int, float]],
    config: BeamConfig,
) -> CatalogStep:
    """The next beams of a catalog group from each beam's log-prob row."""
    offered = legal_rows(catalog, beams, rows, config)
    at_leaf = catalog.is_leaf(
        torch.tensor([beam.node for beam in beams], dtype=torch.long).to(catalog.device)
    ).tolist()
    completed: list[BeamSearchSequence] = []
    live: list[tuple[Beam, dict[int, float]]] = []
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
