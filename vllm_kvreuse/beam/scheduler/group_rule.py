"""What differs between plain beams and beams inside a SID catalog.

A group gets one rule object when it starts (:func:`rule_for`) and asks
it, never a flag, how to rank a fork step's rows on the host, what a fork
member must carry for the workers' catalog mask, and which trie node each
next beam is on. Live and root steps rank on the device
(:mod:`vllm_kvreuse.beam.worker.select`, given each beam's node by the
group's plan); both rules turn that result into a
:class:`~vllm_kvreuse.beam.rule.Step` alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from vllm_kvreuse.beam.catalog.rule import catalog_args, catalog_step
from vllm_kvreuse.beam.catalog.trie import SidCatalog
from vllm_kvreuse.beam.plan import GroupResult
from vllm_kvreuse.beam.rule import (
    Beam,
    BeamConfig,
    Row,
    Step,
    expand,
    step_from_result,
)


class PlainRule:
    """vLLM's rule over the whole vocabulary."""

    def host_step(
        self, beams: Sequence[Beam], rows: Sequence[Row | Mapping[int, float]],
        config: BeamConfig,
    ) -> tuple[Step, list[int]]:  # fmt: skip
        """A fork step from the members' log-prob rows: the step and each
        next beam's trie node (none here)."""
        return expand(beams, rows, config), []

    def device_step(
        self, result: GroupResult, beams: Sequence[Beam], config: BeamConfig
    ) -> tuple[Step, list[int]]:
        """The step a worker chose next to the logits, and the nodes."""
        step = step_from_result(
            result.parents, result.tokens, result.scores, result.eos_scores,
            result.leaf_done, beams, config,
        )  # fmt: skip
        nodes = [beam.node for beam in beams]
        return step, self.next_nodes(nodes, result.parents, result.tokens)

    def next_nodes(
        self, nodes: Sequence[int], parents: list[int], tokens: list[int]
    ) -> list[int]:
        """Each next beam's trie node, from its parent's (``nodes``: the
        current beams')."""
        return []

    def fork_args(self, nodes: list[int], config: BeamConfig) -> list[dict[str, int]]:
        """What each next fork member carries for the workers (nothing here)."""
        return [{} for _ in nodes]


class CatalogRule(PlainRule):
    """The rule inside the server's SID catalog (CPU copy of the trie)."""

    def __init__(self, catalog: SidCatalog) -> None:
        self.catalog = catalog

    def host_step(
        self, beams: Sequence[Beam], rows: Sequence[Row | Mapping[int, float]],
        config: BeamConfig,
    ) -> tuple[Step, list[int]]:  # fmt: skip
        constrained = catalog_step(self.catalog, beams, rows, config)
        return constrained.step, constrained.nodes

    def next_nodes(
        self, nodes: Sequence[int], parents: list[int], tokens: list[int]
    ) -> list[int]:
        if not parents:
            return []
        device = self.catalog.device
        parent_nodes = torch.tensor([nodes[p] for p in parents], device=device)
        tokens_now = torch.tensor(tokens, device=device)
        children = self.catalog.child(parent_nodes, tokens_now)
        assert bool((children >= 0).all()), "a live catalog beam left the catalog"
        return children.tolist()

    def fork_args(self, nodes: list[int], config: BeamConfig) -> list[dict[str, int]]:
        """The trie node (and, at an item, its EOS) the catalog processor
        masks a fork member's row with."""
        return catalog_args(self.catalog, config, nodes)


def rule_for(config: BeamConfig, catalog: SidCatalog | None) -> PlainRule:
    """The group's rule; a catalog group on a server without a catalog is
    the caller's mistake (``ValueError``)."""
    if not config.sid_catalog:
        return PlainRule()
    if catalog is None:
        raise ValueError("sid_catalog beams need a server started with --sid-catalog")
    return CatalogRule(catalog)
