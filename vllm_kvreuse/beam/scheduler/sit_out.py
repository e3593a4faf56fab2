"""Which live members sit out a ``schedule()``: a group steps whole or not.

A live group's step needs every member's row in one batch
(:mod:`.live`). Before each ``schedule()`` the ready members of a group sit
out while a sibling is not ready (still recomputing after a preemption,
which stops one token short, :func:`cap`, so that its last token runs
with its siblings'), or while samples made outside a group step are in
flight, or once the group's last step is scheduled. They are held out of
the running queue, seats and all, by the core's holds
(:mod:`vllm_kvreuse.core.holds`, for the reason :data:`REASON`); under
memory pressure the members that sat out while a sibling waits are
preempted (:func:`stalled`). Pure decisions: nothing here changes state.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING

from vllm.v1.request import Request, RequestStatus

if TYPE_CHECKING:
    from vllm_kvreuse.beam.scheduler.group import BeamGroup
    from vllm_kvreuse.core.upstream.scheduler import Upstream

REASON = "live member waits for its group"
"""Why a live member sits out a ``schedule()`` (``core.holds``)."""


def ready(request: Request | None) -> bool:
    """Running with exactly one token to compute: the group step's row."""
    return (
        request is not None
        and request.status == RequestStatus.RUNNING
        and request.num_tokens_with_spec
        + request.num_output_placeholders
        - request.num_computed_tokens
        == 1
    )


def to_hold(upstream: Upstream, groups: Iterable[BeamGroup]) -> list[Request]:
    """The running members of every live group that cannot step whole this
    ``schedule()`` (all of them while samples made outside a group step are
    in flight or once its last step is scheduled, else those ready while a
    sibling is not: a sibling still recomputing runs), in queue order: they sit out
    (:meth:`.live.LiveSteps.hold`), keeping their seats. A step in flight holds
    nobody: the workers apply it before they run the next."""
    requests = upstream.requests
    blocked: set[str] = set()
    for group in groups:
        members = group.members
        if group.outside or any(
            sampled_all(requests.get(rid), group) for rid in members
        ):  # samples to take back, or the last step in flight: nothing to run
            blocked.update(members)
            continue
        ready_ones = [rid for rid in members if ready(requests.get(rid))]
        if len(ready_ones) < len(members):
            blocked.update(ready_ones)
    if not blocked:
        return []
    return [r for r in upstream.running_requests() if r.request_id in blocked]


def sampled_all(request: Request | None, group: BeamGroup) -> bool:
    """The member has sampled (or has in flight, with async scheduling) its
    group's last token: tokens 2 .. ``max_tokens``. Its ``max_tokens`` has
    one more (it must never end on its own), which it must not run."""
    if request is None:
        return False
    sampled = request.num_output_tokens + request.num_output_placeholders
    return sampled >= group.config.max_tokens - 1


def cap(request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
    """A recomputing member stops one token short of its end, so that its
    last token runs with its siblings' (a group step); a member with one
    token left runs it."""
    left = request.num_tokens - num_computed_tokens
    if left > 1 and num_computed_tokens + num_new_tokens >= request.num_tokens:
        return left - 1
    return num_new_tokens


def stalled(
    requests: Mapping[str, Request], group: BeamGroup, held: Collection[str]
) -> list[Request]:
    """The group's members that sat out this ``schedule()`` (``held``) while
    a sibling waits (for blocks or a seat they may hold); empty when every
    member runs. Members the step scheduled are never named: their step
    runs."""
    members = [requests.get(rid) for rid in group.members]
    if all(r is not None and r.status == RequestStatus.RUNNING for r in members):
        return []
    return [
        r
        for r in members
        if r is not None and r.status == RequestStatus.RUNNING and r.request_id in held
    ]
