"""Requests held out of upstream's scheduling: the one owner of their queue moves.

Features keep requests from being scheduled for a while: a beam step that
does not fit the free blocks waits whole (:mod:`vllm_kvreuse.beam.scheduler.gate`),
a live beam member sits out while a sibling catches up
(:mod:`vllm_kvreuse.beam.scheduler.live`), a chunked request in paths mode
waits for its paths' scores (:mod:`vllm_kvreuse.chunk_cache.paths.voting`).
A feature asks for it by reason, :meth:`Holds.hold`, and gives it up,
:meth:`Holds.unhold`; it never touches vLLM's queues itself.

:class:`Holds` applies what is held around each upstream ``schedule()``, as
vLLM's own scheduler skips requests blocked on remote KV or a grammar
inside it: the hook layer calls :meth:`Holds.take_out` after every
feature's ``before_schedule`` and :meth:`Holds.put_back` as soon as
upstream's ``schedule()`` returns. Between steps every held request is in
vLLM's queues as upstream left it, so upstream's own finishing, aborting
and counting see it there.

Rules, whatever the features ask:

- a finished request is never held: :meth:`~Holds.hold` refuses one,
  :meth:`~Holds.take_out` passes one over, :meth:`~Holds.put_back` leaves
  out one that finished meanwhile, and a freed request's holds are dropped
  (:meth:`~Holds.forget`, from the layer's ``_free_request``);
- a held waiting request leaves the waiting queue and comes back at its
  head; a held running request leaves the running queue with its seat
  (the seat limits shrink while it sits out) and comes back at the head
  of the running queue, last to be preempted; a request in neither queue
  (waiting with KV held for a connector) stays where it is;
- requests come back in the order they stood in their queue when taken
  out, whichever features held them: one take-out and one put-back for
  all, so the order never depends on the feature list.

This module is the only one that moves requests out of vLLM's queues and
back for holding: through ``Upstream.take_out_of_queues`` and
``Upstream.put_back_into_queues`` (:mod:`vllm_kvreuse.core.upstream.scheduler`),
which nothing else calls (``tests/unit/test_holds.py``).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from vllm_kvreuse.core.upstream.scheduler import Upstream


class Holds:
    """What each feature holds, by request and reason; its queue moves.

    Changed only here: ``taken``, the requests out of the waiting and the
    running queue during the ``schedule()`` in progress (empty between
    steps); ``_last``, those the last ``schedule()`` ran without and the
    holds as they stood then (read by :attr:`last_out` and :meth:`summary`).
    A request's reasons are a frozenset replaced on every change, so the
    holds of a step are kept by a shallow copy: the per-step cost is a few
    C-level passes, whatever a beam group's width.
    """

    def __init__(self, upstream: Upstream) -> None:
        self._upstream = upstream
        self._held: dict[str, tuple[Request, frozenset[str]]] = {}
        self._of_reason: dict[str, set[str]] = {}  # reason -> ids it holds
        self.taken: tuple[list[Request], list[Request]] = ([], [])
        self._last: tuple[list[Request], list[Request], dict] = ([], [], {})

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    # -- what features ask --------------------------------------------------------

    def hold(self, request: Request, reason: str) -> bool:
        """Keeps ``request`` out of upstream's scheduling for ``reason``
        until :meth:`unhold`; False (nothing held) for a finished one."""
        if request.is_finished():
            return False
        held = self._held.get(request.request_id)
        if held is None or held[0] is not request:
            if held is not None:  # another request under the same id
                self._unindex(request.request_id, held[1])
            self._held[request.request_id] = (request, _only(reason))
        elif reason not in held[1]:
            self._held[request.request_id] = (request, held[1] | {reason})
        self._of_reason.setdefault(reason, set()).add(request.request_id)
        return True

    def unhold(self, request_id: str, reason: str) -> None:
        """Gives up ``reason``'s hold on ``request_id``; held for no reason
        left, it is scheduled again from the next step."""
        held = self._held.get(request_id)
        if held is not None and reason in held[1]:
            self._unindex(request_id, (reason,))
            left = held[1] - {reason}
            if left:
                self._held[request_id] = (held[0], left)
            else:
                del self._held[request_id]

    def unhold_all(self, reason: str) -> None:
        """Gives up every hold for ``reason`` (its own ids, not every hold)."""
        for request_id in list(self._of_reason.get(reason, ())):
            self.unhold(request_id, reason)

    def held(self, reason: str | None = None) -> list[Request]:
        """The requests held for ``reason`` (None: for any), in the order
        they were first held."""
        return [r for r, why in self._held.values() if reason is None or reason in why]

    # -- what the hook layer does ---------------------------------------------------

    def forget(self, request_id: str) -> None:
        """``request_id`` is being freed: every hold on it goes."""
        held = self._held.pop(request_id, None)
        if held is not None:
            self._unindex(request_id, held[1])

    def _unindex(self, request_id: str, reasons: Iterable[str]) -> None:
        for reason in reasons:
            ids = self._of_reason.get(reason)
            if ids is not None:
                ids.discard(request_id)
                if not ids:
                    del self._of_reason[reason]

    def take_out(self) -> None:
        """Right before upstream's ``schedule()``: every held, unfinished
        request leaves its queue (a running one with its seat). A finished
        request is in neither queue (upstream takes it out as it finishes):
        the queues' own pass over what is held passes it over."""
        assert self.taken == ([], []), "held requests taken out twice"
        if self._held:
            self.taken = self._upstream.take_out_of_queues(self._held)
        self._last = (*self.taken, dict(self._held))

    @property
    def last_out(self) -> tuple[list[str], list[str]]:
        """The ids the last ``schedule()`` ran without, each queue's in
        queue order."""
        waiting, running, _ = self._last
        return [r.request_id for r in waiting], [r.request_id for r in running]

    def put_back(self) -> None:
        """Right after upstream's ``schedule()``: what :meth:`take_out` took
        comes back, each queue's in its order, finished ones left out."""
        waiting, running = self.taken
        self.taken = ([], [])
        if waiting or running:
            self._upstream.put_back_into_queues(waiting, running)

    def summary(self) -> dict[str, int]:
        """What the last ``schedule()`` kept out, by reason (stall logs)."""
        waiting, running, held = self._last
        return dict(
            Counter(
                reason
                for request in (*waiting, *running)
                for reason in held[request.request_id][1]
            )
        )


@functools.cache
def _only(reason: str) -> frozenset[str]:
    """The reasons of a request held for ``reason`` alone: one object per
    reason (a beam group's hundreds of members share it)."""
    return frozenset((reason,))
