"""Live beams: one engine request per beam for the whole search.

After the group's first step (its members are spawned as children of the
root), a member request is never finished by a step: when every member has
sampled, the beam step picks the next beams and each member is *re-seated*
(:mod:`vllm_kvreuse.core.reseat`) onto the beam it now carries:

- a parent's first child keeps the parent's request: its KV stays where it
  is, and only its last token changes when the chosen token is not the one
  the member sampled (and, for catalog beams, its trie node);
- every further child takes the request of a parent that has no child
  (a *spare*): the parent's full blocks by reference, its partial tail
  copy-on-write, all copies of a step in one batch;
- spares left over are aborted (fewer beams: EOS, a narrow catalog prefix);
- a child with no spare left (more beams than members) is forked the old
  way: its parent is held in the ledger and a new member is spawned.

So a step moves as many requests as beams died, and the worker hears about
those only (upstream's streaming-input update); everything else decodes as
an ordinary running request.

Between a member's output and its group's next step (its siblings have not
all sampled, or with async scheduling its output is still in flight) the
member must not run: :func:`to_hold` names such members, and the upstream
seam (:class:`~vllm_kvreuse.core.upstream.Upstream`) takes them out of the
running queue for one ``schedule()`` and puts them back after it. Only a
width that fits the running seats (``max_num_seqs``) lives.

This module only decides (which members sit out a step, which request
carries which beam, who is stalled); :mod:`vllm_kvreuse.core.upstream` and
:mod:`vllm_kvreuse.core.reseat` apply it to upstream's state.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING

from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request, RequestStatus

from vllm_kvreuse.core.request_keys import PARENT

if TYPE_CHECKING:
    from vllm_kvreuse.beam.group import BeamGroup
    from vllm_kvreuse.core.upstream import Upstream


def carriers(
    parents: list[str], children: list[str]
) -> tuple[list[str | None], list[str]]:
    """Which request carries each next beam.

    ``parents``: this step's members, in beam order; ``children``: for each
    next beam, in order, its parent's member. Returns, for each child, its
    parent's member if it is that parent's first child, else None; and the
    spares (members whose beam has no child), in beam order.
    """
    taken: set[str] = set()
    rows: list[str | None] = []
    for parent in children:
        if parent in taken:
            rows.append(None)
        else:
            taken.add(parent)
            rows.append(parent)
    return rows, [p for p in parents if p not in taken]


def to_hold(
    upstream: Upstream,
    member_group: Mapping[str, BeamGroup],
) -> list[Request]:
    """The running live members that have sampled this step (their
    group's ``sampled``) or whose output is still in flight (async
    scheduling), in queue order: they sit out the next ``schedule()``
    (:meth:`Upstream.hold`), keeping their seats."""
    return [
        r
        for r in upstream.running_requests()
        if (group := member_group.get(r.request_id)) is not None
        and group.live
        and r.request_id != group.root_id
        and (r.request_id in group.sampled or upstream.in_flight(r))
    ]


def stalled(requests: Mapping[str, Request], group: BeamGroup) -> list[Request]:
    """The group's members that have sampled this step and wait
    for a sibling that is not running; empty if none wait or every missing
    sibling runs. A running sibling (its output in flight) samples without
    help: preempting the waiting members then would only swap which member
    waits, step after step. ``requests``: the scheduler's, by id."""
    members = [requests.get(beam.request_id) for beam in group.beams]
    sampled = group.sampled
    done = [r for r in members if r is not None and r.request_id in sampled]
    missing = [r for r in members if r is None or r.request_id not in sampled]
    if any(r is None or r.status != RequestStatus.RUNNING for r in missing):
        return done
    return []


def with_catalog_args(request: Request, catalog_args: dict[str, int]) -> SamplingParams:
    """A copy of ``request``'s sampling params carrying a new trie node (a
    new object: an in-process worker may still hold the old one)."""
    params = copy.copy(request.sampling_params)
    assert params is not None and params.extra_args is not None
    params.extra_args = {PARENT: params.extra_args[PARENT], **catalog_args}
    return params
