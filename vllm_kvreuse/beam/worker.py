"""A step's beam groups inside a worker's sampler, on the logits' device.

The model runner hands the sampler a :class:`BeamJob` for a step whose
scheduler output names beam groups (:mod:`.plan`); the sampler calls
:meth:`BeamJob.prepare` with the raw logits before it samples (it may scale
or mask them in place) and :meth:`BeamJob.finish` with its sampled tokens.
For each group, :mod:`.select` picks the next beams and :func:`carriers
<vllm_kvreuse.beam.select.carriers>` the member row that carries each; the
row's sampled token becomes the token of the beam it carries, so every
next step's input is right without the scheduler. The packed results
(:class:`~vllm_kvreuse.beam.plan.PackedResult`) are copied off the device
without waiting (the runner's own output copy waits for them).

Runner-agnostic: the runners' patches (:mod:`vllm_kvreuse.beam.runner_hooks`)
say which logits row holds which request.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from vllm_kvreuse.beam.catalog import SidCatalog
from vllm_kvreuse.beam.plan import GroupStep, PackedResult
from vllm_kvreuse.beam.select import (
    Rule,
    Selection,
    carriers,
    select_catalog,
    select_plain,
)


class BeamStepError(RuntimeError):
    """A scheduled group's rows are not all in the batch the sampler saw."""


@dataclass(slots=True)
class _Prepared:
    step: GroupStep
    rows: torch.Tensor  # [B] logits rows of the members, beam order
    logits: torch.Tensor  # [B, V] raw logits (a copy)


class BeamJob:
    """The beam groups of one sampler call."""

    def __init__(
        self,
        steps: list[GroupStep],
        catalog: Callable[[], SidCatalog | None],
        row_of: Mapping[str, int] | None = None,
    ) -> None:
        self.steps = steps
        self._catalog = catalog  # loaded on first use (catalog groups only)
        self.row_of = row_of
        self._prepared: list[_Prepared] = []
        self.results: dict[str, PackedResult] = {}

    def prepare(
        self, logits: torch.Tensor, row_of: Mapping[str, int] | None = None
    ) -> None:
        """Copies each group's raw logits rows (``row_of``: request id ->
        row of ``logits``; default: the job's). Mutates nothing."""
        row_of = self.row_of if row_of is None else row_of
        assert row_of is not None, "the runner names no logits rows"
        device = logits.device
        for step in self.steps:
            missing = [m for m in step.member_ids if m not in row_of]
            if missing:
                raise BeamStepError(
                    f"beam group {step.group_id}: members {missing[:4]} are not in "
                    "this batch"
                )
            rows = torch.tensor([row_of[m] for m in step.member_ids], device=device)
            self._prepared.append(_Prepared(step, rows, logits[rows]))

    def finish(self, sampled: torch.Tensor) -> None:
        """Selects each group's next beams; overwrites the sampled token of
        every row that carries a next beam with that beam's token (``sampled``:
        ``[N, 1]`` or ``[N]``, the sampler's output, changed in place)."""
        flat = sampled.view(-1)
        for prep in self._prepared:
            step = prep.step
            sel = self._select(prep, flat[prep.rows])
            num_members = len(step.member_ids)
            carrier = carriers(sel.parents, sel.valid, num_members)
            # Each member row's token: the one of the beam it carries, else
            # its own draw. Carriers are distinct; the rest go to a dummy slot.
            slot = torch.where(carrier >= 0, carrier, num_members)
            tokens = torch.cat((flat[prep.rows], flat.new_zeros(1)))
            tokens.scatter_(0, slot, sel.tokens.to(flat.dtype))
            flat[prep.rows] = tokens[:num_members]
            self.results[step.group_id] = _pack(sel, carrier)
        self._prepared.clear()

    def _select(self, prep: _Prepared, sampled: torch.Tensor) -> Selection:
        step = prep.step
        device = prep.logits.device
        cum = torch.tensor(step.cum_logprobs, dtype=torch.float64, device=device)
        rule = Rule(step.width, step.eos, step.row_size)
        if step.nodes is None:
            return select_plain(prep.logits, cum, rule, sampled=sampled)
        catalog = self._catalog()
        assert catalog is not None, "a catalog group on a worker without one"
        nodes = torch.tensor(step.nodes, device=catalog.device)
        children, _ = catalog.legal(nodes)
        at_leaf = catalog.is_leaf(nodes)
        return select_catalog(
            prep.logits, cum, rule, children.to(device), at_leaf.to(device)
        )


def _pack(sel: Selection, carrier: torch.Tensor) -> PackedResult:
    """The selection as two float64 tensors, copied to the host without
    waiting (pinned memory on an accelerator)."""
    nxt = torch.stack(
        (sel.parents.double(), sel.tokens.double(), sel.scores, carrier.double(),
         sel.valid.double()),
        dim=1,
    )  # fmt: skip
    beams = torch.stack(
        (sel.eos_done.double(), sel.eos_scores, sel.leaf_done.double(),
         torch.zeros_like(sel.eos_scores)),
        dim=1,
    )  # fmt: skip
    if nxt.device.type == "cpu":
        return PackedResult(nxt, beams)
    return PackedResult(
        nxt.to("cpu", non_blocking=True), beams.to("cpu", non_blocking=True)
    )
