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
member must not run: :func:`hold_out` takes such members out of the running
queue for one ``schedule()``, and :func:`put_back` returns them. Only a
width that fits the running seats (``max_num_seqs``) lives.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request, RequestStatus

from vllm_kvreuse.core.request_keys import PARENT

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_kvreuse.beam.group import BeamGroup


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


def hold_out(
    scheduler: Scheduler,
    member_group: Mapping[str, BeamGroup],
    sampled: Collection[str],
) -> list[Request]:
    """Takes out of the running queue every live member that has sampled
    this step (``sampled``) or whose output is still in flight (async
    scheduling); returns them in queue order. They keep their seats: the
    admission limits shrink by as many until :func:`put_back`."""
    running = scheduler.running
    held = [
        r
        for r in running
        if (group := member_group.get(r.request_id)) is not None
        and group.live
        and r.request_id != group.root_id
        and (r.request_id in sampled or r.num_output_placeholders > 0)
    ]
    if held:
        gone = set(map(id, held))
        running[:] = [r for r in running if id(r) not in gone]
        scheduler.max_num_running_reqs -= len(held)
        scheduler.max_num_active_reqs -= len(held)
    return held


def put_back(scheduler: Scheduler, held: list[Request]) -> None:
    """Returns held requests, and their seats, to the head of the running
    queue: they have already run this step, so they are the last to be
    preempted."""
    scheduler.running[:0] = held
    scheduler.max_num_running_reqs += len(held)
    scheduler.max_num_active_reqs += len(held)


def stalled(
    scheduler: Scheduler, group: BeamGroup, sampled: Collection[str]
) -> list[Request]:
    """The group's members that have sampled this step (``sampled``) and wait
    for a sibling that is not running; empty if none wait or every missing
    sibling runs. A running sibling (its output in flight) samples without
    help: preempting the waiting members then would only swap which member
    waits, step after step."""
    members = [scheduler.requests.get(beam.request_id) for beam in group.beams]
    done = [r for r in members if r is not None and r.request_id in sampled]
    missing = [r for r in members if r is None or r.request_id not in sampled]
    if any(r is None or r.status != RequestStatus.RUNNING for r in missing):
        return done
    return []


def preempt(scheduler: Scheduler, requests: list[Request]) -> None:
    """Preempts running ``requests`` as upstream does (out of the running
    queue, blocks freed, back to waiting). Only for requests this step did
    not schedule."""
    scheduler.running[:] = [r for r in scheduler.running if r not in requests]
    now = time.monotonic()
    for request in requests:
        scheduler._preempt_request(request, now)


def unsample(request: Request, hash_block_size: int) -> None:
    """Takes back a member's sampled token (its row was dropped): it will
    compute the same position again."""
    request._all_token_ids.pop()
    if request._output_token_ids:
        request._output_token_ids.pop()
    del request.block_hashes[request.num_tokens // hash_block_size :]


def with_catalog_args(request: Request, catalog_args: dict[str, int]) -> SamplingParams:
    """A copy of ``request``'s sampling params carrying a new trie node (a
    new object: an in-process worker may still hold the old one)."""
    params = copy.copy(request.sampling_params)
    assert params is not None and params.extra_args is not None
    params.extra_args = {PARENT: params.extra_args[PARENT], **catalog_args}
    return params
