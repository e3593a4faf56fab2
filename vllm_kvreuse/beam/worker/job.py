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
from dataclasses import astuple, dataclass

import torch

from vllm_kvreuse.beam.catalog.trie import SidCatalog
from vllm_kvreuse.beam.plan import GroupStep, PackedResult
from vllm_kvreuse.beam.worker.segments import (
    Segments,
    block_pairs,
    cached_layout,
    members_per_group,
    to_device,
)
from vllm_kvreuse.beam.worker.select import (
    Selection,
    logprobs_of,
    select_catalog_rows,
    select_rows,
)
from vllm_kvreuse.beam.worker.state import GroupState

BlockCopier = Callable[[torch.Tensor, torch.Tensor], None]
"""Copies KV blocks ``src[i]`` to ``dst[i]`` (scheduler block ids) in every layer."""


SCRATCH_BYTES = 64 << 20
"""The largest buffer a runner keeps across steps (``BeamJob``'s scratch)."""


class BeamStepError(RuntimeError):
    """A scheduled group's rows are not all in the batch the sampler saw."""


@dataclass(slots=True)
class _Batch:
    """Groups of one kind selected together, as :meth:`BeamJob.prepare`
    found them: ``rows [R]`` their members' logits rows, group after group;
    ``beam_rows [R]`` each beam slot's member (an index into ``rows``);
    ``logprobs [R, V]`` the members' raw log-probs, in member order (beam
    ``b``'s in row ``beam_rows[b]``)."""

    steps: list[GroupStep]
    states: list[GroupState]
    seg: Segments
    rows: torch.Tensor
    carried_by: torch.Tensor
    alive: torch.Tensor
    beam_rows: torch.Tensor
    logprobs: torch.Tensor


class BeamJob:
    """The beam groups of one sampler call, selected together: one batch
    per kind of group (plain, catalog), however many groups
    (:mod:`.segments`).

    ``states``: the runner's live groups by id (read and advanced);
    ``catalog``: loads the SID catalog (catalog groups only); ``row_of``:
    request id -> logits row (or given to :meth:`prepare`); ``copy_blocks``:
    the runner's KV block copy (None: nothing to copy, as in tests without
    KV); ``scratch``: the runner's buffers kept across steps (CPU).
    """

    def __init__(
        self,
        steps: list[GroupStep],
        states: dict[str, GroupState],
        catalog: Callable[[], SidCatalog | None],
        row_of: Mapping[str, int] | None = None,
        copy_blocks: BlockCopier | None = None,
        scratch: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.steps = steps
        self._scratch = scratch
        self.states = states
        self._catalog = catalog
        self.row_of = row_of
        self._copy_blocks = copy_blocks
        self._batches: list[_Batch] = []
        self.results: dict[str, PackedResult] = {}

    def prepare(
        self, logits: torch.Tensor, row_of: Mapping[str, int] | None = None
    ) -> None:
        """Takes the groups' log-probs from the raw logits, before the
        sampler may change them (``row_of``: request id -> row of
        ``logits``; default: the job's); forgets ended groups."""
        row_of = self.row_of if row_of is None else row_of
        assert row_of is not None, "the runner names no logits rows"
        live = []
        for step in self.steps:
            if step.kind == "end":
                self.states.pop(step.group_id, None)
            else:
                live.append(step)
        for catalog in (False, True):
            steps = [s for s in live if s.catalog == catalog]
            if steps:
                self._batches.append(self._batch(steps, logits, row_of))

    def _batch(
        self, steps: list[GroupStep], logits: torch.Tensor, row_of: Mapping[str, int]
    ) -> _Batch:
        ids = [row_of.get(m, -1) for step in steps for m in step.member_ids]
        for step in steps if -1 in ids else ():
            if missing := [m for m in step.member_ids if m not in row_of]:
                raise BeamStepError(
                    f"beam group {step.group_id}: members {missing[:4]} are "
                    "not in this batch"
                )
        device = logits.device
        states = [self._state_of(step, device) for step in steps]
        shape = [(len(s.carriers), *astuple(s.rule)) for s in states]
        seg = cached_layout(*zip(*shape, strict=True), device)  # type: ignore[arg-type]
        assert seg.total_rows == len(ids), "a group's slots are its members"
        rows = to_device(ids, device)
        carried_by = torch.cat([s.carriers for s in states])
        beam_rows = seg.row_first + carried_by
        kind = "catalog" if steps[0].catalog else "plain"
        shape = (len(ids), logits.shape[1])
        first = ids[0]
        if ids == list(range(first, first + len(ids))):  # no copy: a view
            taken = logits[first : first + len(ids)]
        else:
            taken = self._buffer(f"{kind}-logits", shape, logits.dtype, device)
            taken = torch.index_select(logits, 0, rows, out=taken)
        logprobs = self._buffer(f"{kind}-logprobs", shape, torch.float32, device)
        return _Batch(
            steps, states, seg, rows, carried_by, torch.cat([s.alive for s in states]),
            beam_rows, logprobs_of(taken, out=logprobs),
        )  # fmt: skip

    def _buffer(
        self, name: str, shape: tuple[int, int], dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor | None:  # fmt: skip
        """A scratch tensor kept across steps, on CPU (None elsewhere: the
        caching allocator keeps them there; and past :data:`SCRATCH_BYTES`,
        not to keep a wide search's memory for good). On CPU a fresh
        ``R x V`` tensor each step costs as much as the pass that fills it."""
        size = shape[0] * shape[1]
        if self._scratch is None or device.type != "cpu":
            return None
        if size * dtype.itemsize > SCRATCH_BYTES:
            return None
        buffer = self._scratch.get(name)
        if buffer is None or buffer.numel() < size or buffer.dtype != dtype:
            buffer = self._scratch[name] = torch.empty(size, dtype=dtype)
        return buffer[:size].view(shape)

    def holds_every_row(self, num_rows: int) -> bool:
        """Whether the groups' members are all ``num_rows`` rows the sampler
        sees (after :meth:`prepare`; each member is one row)."""
        return sum(len(batch.rows) for batch in self._batches) == num_rows

    def reads_draws(self, all_greedy: bool) -> bool:
        """Whether a group's step reads the sampler's draws: a plain group
        whose EOS ends beams, when the draw may be other than the row's
        best token (:func:`.select.eos_rows`: a drawn EOS ends its beam).
        A greedy draw is the raw argmax (members carry no bias, penalty or
        minimum length: :func:`~vllm_kvreuse.beam.scheduler.group.member_request`),
        which ranks first in its row and ends a beam by rank already."""
        if all_greedy:
            return False
        return any(
            step.eos >= 0 and not step.catalog
            for batch in self._batches
            for step in batch.steps
        )

    def finish(self, sampled: torch.Tensor, drawn: bool = True) -> None:
        """Runs every group's step and applies it (module docstring);
        ``sampled``: ``[N, 1]`` or ``[N]``, the sampler's output, whose
        carriers' tokens are overwritten in place. ``drawn`` False: the
        sampler did not run (:meth:`reads_draws` was False) and ``sampled``
        holds placeholders; a member left without a beam keeps one."""
        batches, self._batches = self._batches, []
        for batch in batches:
            self._run(batch, sampled.view(-1), drawn)

    def _run(self, batch: _Batch, flat: torch.Tensor, drawn: bool) -> None:
        steps, states, seg = batch.steps, batch.states, batch.seg
        sampled = flat[batch.rows]
        nodes = None
        if steps[0].catalog:
            nodes = torch.cat([s.nodes for s in states if s.nodes is not None])
        cum, drawn_beams = torch.cat([s.cum for s in states]), None
        if drawn:
            drawn_beams = sampled[batch.beam_rows]
        sel = self._select(batch, cum, drawn_beams, nodes)
        member = members_per_group(
            seg, batch.carried_by, batch.alive, sel.parents, sel.valid
        )
        # Each member row's token: its new beam's, else its own draw.
        total = seg.total_rows
        slot = torch.where(member >= 0, seg.out_row_first + member, total)
        tokens = torch.cat((sampled, flat.new_zeros(1)))
        tokens.scatter_(0, slot, sel.tokens.to(flat.dtype))
        flat[batch.rows] = tokens[:total]
        source = batch.carried_by[seg.out_row_first + sel.parents]
        self._copy(steps, seg, sel, source, member)
        self._advance(steps, states, seg, sel, member, nodes)
        nxt, beams = sel.packed(member)
        for step, out, mine in zip(
            steps, seg.out_slices(), seg.row_slices(), strict=True
        ):
            self.results[step.group_id] = PackedResult(nxt[out], beams[mine])

    def _state_of(self, step: GroupStep, device: torch.device) -> GroupState:
        if step.kind != "step":
            catalog = self._catalog() if step.catalog and step.nodes else None
            level = catalog.level_at(step.nodes[0]) if catalog and step.nodes else 0
            return GroupState.of(step, device, level)
        if step.group_id not in self.states:
            raise BeamStepError(f"beam group {step.group_id}: no state here")
        return self.states[step.group_id]

    def _select(
        self, batch: _Batch, cum: torch.Tensor, sampled: torch.Tensor | None,
        nodes: torch.Tensor | None,
    ) -> Selection:  # fmt: skip
        seg, logprobs, alive = batch.seg, batch.logprobs, batch.alive
        order = batch.beam_rows  # logprobs are in member order
        if nodes is None:
            return select_rows(logprobs, cum, seg, sampled, alive=alive, order=order)
        catalog = self._catalog()
        assert catalog is not None, "catalog group"
        at, device = nodes.to(catalog.device), logprobs.device
        levels = {state.level for state in batch.states}
        children = catalog.legal(at, levels)[0].to(device)
        at_leaf = catalog.is_leaf(at)
        return select_catalog_rows(
            logprobs, cum, seg, children, at_leaf.to(device), alive, order
        )

    def _copy(
        self, steps: list[GroupStep], seg: Segments, sel: Selection,
        source: torch.Tensor, member: torch.Tensor,
    ) -> None:  # fmt: skip
        """Copies each moved beam's parent's private blocks into the member
        that now carries it, every group's in one call, fixed shapes (the
        others copy onto themselves; on CPU the copier leaves those out); a
        root copies nothing."""
        if self._copy_blocks is None:
            return
        per_member = [_private_count(step) for step in steps]
        if not any(per_member):
            return
        moved = sel.valid & (member >= 0) & (member != source)
        dst_member = torch.where(moved, member, source)
        src, dst = block_pairs(
            seg, per_member, [s.blocks for s in steps], source, dst_member
        )
        self._copy_blocks(src, dst)

    def _advance(
        self, steps: list[GroupStep], states: list[GroupState], seg: Segments,
        sel: Selection, member: torch.Tensor, nodes: torch.Tensor | None,
    ) -> None:  # fmt: skip
        """Each group's next state (a root's next step starts afresh)."""
        if all(step.kind == "root" for step in steps):
            return
        if nodes is not None:
            catalog = self._catalog()
            assert catalog is not None
            parent_nodes = nodes[seg.out_row_first + sel.parents]
            child = catalog.child(
                parent_nodes.to(catalog.device), sel.tokens.to(catalog.device)
            )
            nodes = child.to(nodes.device).clamp(min=0)
        alive = sel.valid & (member >= 0)
        carriers = member.clamp(min=0)
        for step, state, out in zip(steps, states, seg.out_slices(), strict=True):
            if step.kind == "root":
                continue
            self.states[step.group_id] = GroupState(
                rule=state.rule,
                catalog=state.catalog,
                carriers=carriers[out],
                cum=sel.scores[out],
                nodes=None if nodes is None else nodes[out],
                alive=alive[out],
                level=state.level + 1,
            )


def _private_count(step: GroupStep) -> int:
    """Blocks per member a step may copy (a root copies none)."""
    if step.kind == "root" or not step.blocks or not step.blocks[0]:
        return 0
    return len(step.blocks[0][0])
