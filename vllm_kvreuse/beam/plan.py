"""What the scheduler tells the workers about a step's beam groups, and back.

A beam group's step runs next to the logits (:mod:`.worker.job`), so each
scheduler output names the groups whose rows it schedules (a
:class:`GroupStep` each, in ``SchedulerOutput.kvreuse_beam_steps``), and the
model runner's output returns each group's chosen beams (a packed
:class:`GroupResult` each, in ``ModelRunnerOutput.kvreuse_beam_results``).
Both are plain attributes added to upstream's dataclasses, which travel to
and from the workers whole (in process, or pickled); :func:`steps_of` and
:func:`results_of` read them where absent.

A live group's beams are state of the workers from its first step on
(``kind="start"``: which member carries which beam, the scores, the trie
nodes): a worker applies each step itself (the carriers' sampled tokens,
their KV copied from their parents', the state advanced), so the next step
needs nothing from the scheduler and can be scheduled before this one's
result is in (async scheduling). Later steps (``"step"``) name the members
and where their private KV lies; ``"end"`` forgets the group. A root's step
(``"root"``) is one row and no state.

Results cross as two float64 tensors per group (one copy off the device;
ids and flags are exact in float64), unpacked on the host by
:meth:`GroupResult.unpack`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

STEPS_ATTR = "kvreuse_beam_steps"
"""``SchedulerOutput`` attribute: the :class:`GroupStep` list of the step."""
RESULTS_ATTR = "kvreuse_beam_results"
"""``ModelRunnerOutput`` attribute: group id -> :class:`PackedResult`."""
OUTSIDE_ATTR = "kvreuse_beam_outside"
"""``SchedulerOutput`` attribute, the scheduler's own: members that output
samples outside a group step (taken back when its outputs come)."""

Kind = Literal["root", "start", "step", "end"]


@dataclass(frozen=True, slots=True)
class GroupStep:
    """One group in one scheduler output.

    ``member_ids``: the requests whose rows the step samples (a live
    group's, in the group's fixed member order; a root's: itself).
    ``width``, ``eos`` (the token that ends a beam, -1: none), ``row_size``
    (how deep in its row EOS may rank to end one) and ``catalog``: the rule
    (:mod:`.worker.select`). ``"root"``/``"start"``: ``carriers[b]`` the member
    carrying beam ``b``, ``cum_logprobs[b]`` its score, ``nodes[b]`` its
    trie node (catalog groups). ``"start"``/``"step"``: ``blocks[g][m]``
    member ``m``'s blocks of KV-cache group ``g`` past the prefix all
    members share, up to the last one the step writes (the workers copy a
    parent's into the member that takes its child).
    """

    group_id: str
    kind: Kind
    member_ids: list[str]
    width: int = 0
    eos: int = -1
    row_size: int = 0
    catalog: bool = False
    carriers: list[int] | None = None
    cum_logprobs: list[float] | None = None
    nodes: list[int] | None = None
    blocks: list[list[list[int]]] | None = None


@dataclass(frozen=True, slots=True)
class PackedResult:
    """A group's result as computed on the worker: ``next [W, 5]``
    (parent, token, score, carrier, valid) and ``beams [W, 4]`` (eos_done,
    eos_score, leaf_done, 0), float64, on the host once the output is."""

    next: torch.Tensor
    beams: torch.Tensor


@dataclass(frozen=True, slots=True)
class GroupResult:
    """A group's step as the scheduler reads it.

    Next beams best first: ``parents`` (beam index), ``tokens``, ``scores``,
    ``carriers`` (the member index whose row now samples that beam's token:
    a parent's first child keeps the parent's member, the others take
    spares; -1: no member left). Per current beam: ``eos_scores`` (None if
    EOS did not end it) and ``leaf_done`` (a catalog item complete as is).
    """

    parents: list[int]
    tokens: list[int]
    scores: list[float]
    carriers: list[int]
    eos_scores: list[float | None]
    leaf_done: list[bool]

    @classmethod
    def unpack(cls, packed: PackedResult, num_beams: int) -> GroupResult:
        """``num_beams``: the beams of the step (the rest of ``beams`` rows
        are no beam)."""
        rows = packed.next[packed.next[:, 4] != 0]
        parents, tokens, carriers = rows[:, [0, 1, 3]].long().T.tolist()
        beams = packed.beams[:num_beams]
        ended = (beams[:, 0] != 0).tolist()
        eos_scores: list[float | None] = [None] * len(ended)
        if any(ended):
            scores = beams[:, 1].tolist()
            eos_scores = [s if e else None for e, s in zip(ended, scores, strict=True)]
        return cls(
            parents=parents,
            tokens=tokens,
            scores=rows[:, 2].tolist(),
            carriers=carriers,
            eos_scores=eos_scores,
            leaf_done=(beams[:, 2] != 0).tolist(),
        )


def steps_of(scheduler_output: Any) -> list[GroupStep]:
    return getattr(scheduler_output, STEPS_ATTR, None) or []


def results_of(model_runner_output: Any) -> dict[str, PackedResult]:
    return getattr(model_runner_output, RESULTS_ATTR, None) or {}


def put_steps(scheduler_output: Any, steps: list[GroupStep]) -> None:
    """Names the step's groups in ``scheduler_output`` (its own attribute)."""
    vars(scheduler_output)[STEPS_ATTR] = steps


def put_outside(scheduler_output: Any, request_ids: set[str]) -> None:
    vars(scheduler_output)[OUTSIDE_ATTR] = request_ids


def outside_of(scheduler_output: Any) -> set[str]:
    return getattr(scheduler_output, OUTSIDE_ATTR, None) or set()


def put_results(model_runner_output: Any, results: dict[str, PackedResult]) -> None:
    vars(model_runner_output)[RESULTS_ATTR] = results
