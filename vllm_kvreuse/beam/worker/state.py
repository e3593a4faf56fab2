"""A live beam group's state on a worker, kept by the runner across steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvreuse.beam.plan import GroupStep
from vllm_kvreuse.beam.worker.segments import to_device
from vllm_kvreuse.beam.worker.select import Rule


@dataclass(slots=True)
class GroupState:
    """A group's beams on a worker, ``[M]`` slots (one per member):
    ``carriers[b]`` the member carrying beam ``b``, ``cum[b]`` its score,
    ``nodes[b]`` its trie node; ``alive[b]``: slot ``b`` is a beam;
    ``level``: the trie level of its beams' nodes (a catalog group's beams
    all lie at one, a step deeper each step), known on the host so that
    the catalog's lookups have known shapes."""

    rule: Rule
    catalog: bool
    carriers: torch.Tensor
    cum: torch.Tensor
    nodes: torch.Tensor | None
    alive: torch.Tensor
    level: int = 0

    @classmethod
    def of(cls, step: GroupStep, device: torch.device, level: int = 0) -> GroupState:
        assert step.carriers is not None and step.cum_logprobs is not None
        slots, beams = len(step.member_ids), len(step.carriers)
        pad = slots - beams
        nodes = None
        if step.catalog:
            assert step.nodes is not None
            nodes = to_device([*step.nodes, *[0] * pad], device)
        return cls(
            rule=Rule(step.width, step.eos, step.row_size),
            catalog=step.catalog,
            carriers=to_device([*step.carriers, *[0] * pad], device),
            cum=to_device([*step.cum_logprobs, *[0.0] * pad], device, torch.float64),
            nodes=nodes,
            alive=torch.arange(slots, device=device) < beams,
            level=level,
        )
