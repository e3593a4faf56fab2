"""A step's beam groups inside a worker's sampler, on the logits' device.

The model runner hands the sampler a :class:`BeamJob` for a step whose
scheduler output names beam groups (:mod:`~vllm_kvreuse.beam.plan`); the sampler calls
:meth:`BeamJob.prepare` with the raw logits before it samples (it may scale
or mask them in place) and :meth:`BeamJob.finish` with its sampled tokens.

A live group's beams are worker state (:class:`GroupState`, kept by the
runner across steps): which member carries each beam, the scores, the trie
nodes. Each step, :mod:`.select` picks the next beams and
:func:`~vllm_kvreuse.beam.worker.select.carriers` the member that carries each;
then the worker applies the step itself: each carrier's sampled token
becomes its beam's token (the next step's input), a member that takes
another beam gets that beam's parent's KV (its private blocks copied,
:func:`vllm_kvreuse.device.block_copy.copy_blocks_indexed`), and the state
advances. So the next step runs right, whatever the scheduler has seen
(async scheduling schedules it before this result is in). Only the packed
results (:class:`~vllm_kvreuse.beam.plan.PackedResult`) leave the device,
copied without waiting (the runner's own output copy waits for them).

Runner-agnostic: the runners' patches (:mod:`vllm_kvreuse.beam.worker.runner_hooks`)
say which logits row holds which request and how blocks are copied.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from vllm_kvreuse.beam.catalog.trie import SidCatalog
from vllm_kvreuse.beam.plan import GroupStep, PackedResult
from vllm_kvreuse.beam.worker.select import (
    Rule,
    Selection,
    carriers,
    select_catalog,
    select_plain,
)

BlockCopier = Callable[[torch.Tensor, torch.Tensor], None]
"""Copies KV blocks ``src[i]`` to ``dst[i]`` (scheduler block ids) in every layer."""


class BeamStepError(RuntimeError):
    """A scheduled group's rows are not all in the batch the sampler saw."""


@dataclass(slots=True)
class GroupState:
    """A group's beams on a worker, ``[M]`` slots (one per member):
    ``carriers[b]`` the member carrying beam ``b``, ``cum[b]`` its score,
    ``nodes[b]`` its trie node; ``alive[b]``: slot ``b`` is a beam."""

    rule: Rule
    catalog: bool
    carriers: torch.Tensor
    cum: torch.Tensor
    nodes: torch.Tensor | None
    alive: torch.Tensor

    @classmethod
    def of(cls, step: GroupStep, device: torch.device) -> GroupState:
        assert step.carriers is not None and step.cum_logprobs is not None
        slots, beams = len(step.member_ids), len(step.carriers)
        pad = slots - beams
        long = dict(dtype=torch.long, device=device)
        nodes = None
        if step.catalog:
            assert step.nodes is not None
            nodes = torch.tensor([*step.nodes, *[0] * pad], **long)
        return cls(
            rule=Rule(step.width, step.eos, step.row_size),
            catalog=step.catalog,
            carriers=torch.tensor([*step.carriers, *[0] * pad], **long),
            cum=torch.tensor(
                [*step.cum_logprobs, *[0.0] * pad], dtype=torch.float64, device=device
            ),
            nodes=nodes,
            alive=torch.arange(slots, device=device) < beams,
        )


@dataclass(slots=True)
class _Prepared:
    step: GroupStep
    rows: torch.Tensor  # [M] logits rows of the members, member order
    logits: torch.Tensor  # [M, V] raw logits (a copy)


class BeamJob:
    """The beam groups of one sampler call.

    ``states``: the runner's live groups by id (read and advanced);
    ``catalog``: loads the SID catalog (catalog groups only); ``row_of``:
    request id -> logits row (or given to :meth:`prepare`); ``copy_blocks``:
    the runner's KV block copy (None: nothing to copy, as in tests without
    KV).
    """

    def __init__(
        self,
        steps: list[GroupStep],
        states: dict[str, GroupState],
        catalog: Callable[[], SidCatalog | None],
        row_of: Mapping[str, int] | None = None,
        copy_blocks: BlockCopier | None = None,
    ) -> None:
        self.steps = steps
        self.states = states
        self._catalog = catalog
        self.row_of = row_of
        self._copy_blocks = copy_blocks
        self._prepared: list[_Prepared] = []
        self.results: dict[str, PackedResult] = {}

    def prepare(
        self, logits: torch.Tensor, row_of: Mapping[str, int] | None = None
    ) -> None:
        """Copies each group's raw logits rows (``row_of``: request id ->
        row of ``logits``; default: the job's); forgets ended groups."""
        row_of = self.row_of if row_of is None else row_of
        assert row_of is not None, "the runner names no logits rows"
        device = logits.device
        for step in self.steps:
            if step.kind == "end":
                self.states.pop(step.group_id, None)
                continue
            missing = [m for m in step.member_ids if m not in row_of]
            if missing:
                raise BeamStepError(
                    f"beam group {step.group_id}: members {missing[:4]} are not in "
                    "this batch"
                )
            rows = torch.tensor([row_of[m] for m in step.member_ids], device=device)
            self._prepared.append(_Prepared(step, rows, logits[rows]))

    def finish(self, sampled: torch.Tensor) -> None:
        """Runs each group's step and applies it (module docstring);
        ``sampled``: ``[N, 1]`` or ``[N]``, the sampler's output, whose
        carriers' tokens are overwritten in place."""
        flat = sampled.view(-1)
        for prep in self._prepared:
            step = prep.step
            device = prep.logits.device
            if step.kind == "step":
                if step.group_id not in self.states:
                    raise BeamStepError(f"beam group {step.group_id}: no state here")
                state = self.states[step.group_id]
            else:
                state = GroupState.of(step, device)
            members = state.carriers  # each beam's member
            sel = self._select(state, prep.logits[members], flat[prep.rows][members])
            member = _members_of(sel, state)
            # Each member row's token: its new beam's, else its own draw.
            num = len(step.member_ids)
            slot = torch.where(member >= 0, member, num)
            tokens = torch.cat((flat[prep.rows], flat.new_zeros(1)))
            tokens.scatter_(0, slot, sel.tokens.to(flat.dtype))
            flat[prep.rows] = tokens[:num]
            if step.kind != "root":
                self._copy(step, sel, members[sel.parents], member)
                self.states[step.group_id] = self._advanced(state, sel, member)
            self.results[step.group_id] = _pack(sel, member)
        self._prepared.clear()

    def _select(
        self, state: GroupState, logits: torch.Tensor, sampled: torch.Tensor
    ) -> Selection:
        if not state.catalog:
            return select_plain(
                logits, state.cum, state.rule, sampled, alive=state.alive
            )
        catalog = self._catalog()
        assert catalog is not None and state.nodes is not None, "catalog group"
        nodes = state.nodes.to(catalog.device)
        children, _ = catalog.legal(nodes)
        at_leaf = catalog.is_leaf(nodes)
        device = logits.device
        return select_catalog(
            logits, state.cum, state.rule, children.to(device), at_leaf.to(device),
            alive=state.alive,
        )  # fmt: skip

    def _copy(
        self,
        step: GroupStep,
        sel: Selection,
        source: torch.Tensor,
        member: torch.Tensor,
    ) -> None:
        """Copies each moved beam's parent's private blocks into the member
        that now carries it (the others copy onto themselves, or, on CPU,
        are left out)."""
        if self._copy_blocks is None or not step.blocks or not step.blocks[0][0]:
            return
        moved = sel.valid & (member >= 0) & (member != source)
        dst_member = torch.where(moved, member, source)
        device = member.device
        srcs, dsts = [], []
        for group in step.blocks:
            ids = torch.tensor(group, dtype=torch.long, device=device)  # [M, k]
            srcs.append(ids[source].flatten())
            dsts.append(ids[dst_member].flatten())
        src, dst = torch.cat(srcs), torch.cat(dsts)
        if device.type == "cpu":
            keep = src != dst
            src, dst = src[keep], dst[keep]
        self._copy_blocks(src, dst)

    def _advanced(
        self, state: GroupState, sel: Selection, member: torch.Tensor
    ) -> GroupState:
        nodes = state.nodes
        if nodes is not None:
            catalog = self._catalog()
            assert catalog is not None
            parent_nodes = nodes[sel.parents].to(catalog.device)
            child = catalog.child(parent_nodes, sel.tokens.to(catalog.device))
            nodes = child.to(nodes.device).clamp(min=0)
        alive = sel.valid & (member >= 0)
        return GroupState(
            rule=state.rule,
            catalog=state.catalog,
            carriers=member.clamp(min=0),
            cum=sel.scores,
            nodes=nodes,
            alive=alive,
        )


def _members_of(sel: Selection, state: GroupState) -> torch.Tensor:
    """The member carrying each next beam (-1: none), in fixed shapes: the
    slots of :func:`carriers` are the beams' members in beam order, then
    the members that carry no beam, in member order."""
    num = len(state.carriers)
    device = state.carriers.device
    order = torch.arange(num, device=device)
    key = num + order  # a member with no beam sorts after every beam
    target = torch.where(state.alive, state.carriers, num)
    key = torch.cat((key, key.new_zeros(1))).scatter_(0, target, order)[:num]
    slot_member = torch.argsort(key)
    slot = carriers(sel.parents, sel.valid, num)
    return torch.where(slot >= 0, slot_member[slot.clamp(min=0)], -1)


def _pack(sel: Selection, member: torch.Tensor) -> PackedResult:
    """The selection as two float64 tensors, copied to the host without
    waiting (pinned memory on an accelerator)."""
    nxt = torch.stack(
        (sel.parents.double(), sel.tokens.double(), sel.scores, member.double(),
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
