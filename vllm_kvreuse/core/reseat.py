"""Re-seating running requests onto other running requests' KV.

A re-seat gives a *running* request another request's computed tokens and
KV blocks plus one new token, without the request leaving the running
queue: full blocks by reference, the partial tail copy-on-write. Engine
beam search uses it to keep one request per beam alive across steps.

The scheduler side (this module) decides what moves where; the upstream
seam (:mod:`.upstream`) changes the request, the block tables of the
KV-cache managers and the block references, and queues the tail copies in
the same managers' pending copy-on-write list that upstream drains into
``SchedulerOutput.kv_cache_block_copies`` at the next ``schedule()``. Both
model runners run those copies before the forward pass.

The worker side is upstream's *streaming input update*: a request id that a
worker already knows, sent again in ``scheduled_new_reqs``, has its cached
state (tokens, blocks, computed count, sampling params) replaced and its
persistent-batch row re-added, in both runners (V1
``GPUModelRunner._update_streaming_request``, V2 ``add_requests``). So no
runner is patched: :meth:`Reseats.deliver` moves a re-seated request from
the step's ``scheduled_cached_reqs`` to ``scheduled_new_reqs`` the first
time it is scheduled after the re-seat. As in a streaming update, the whole
history becomes the request's prompt.

Invariants:
- A :class:`Seat` is read before any request of the same batch is changed
  (:meth:`Reseats.move` takes every move of a step at once).
- Each block reference a re-seat takes belongs to the request's block table,
  except the copy endpoints' extra references, which upstream's
  ``_free_cow_retained_blocks`` drops once the copy has run (the same
  accounting as ``SingleTypeKVCacheManager._apply_cow``).
- A re-seated request's worker state is stale until it is delivered; it
  must not be scheduled in between without :meth:`Reseats.deliver` running
  on that step's output (the hook layer calls it after every schedule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams

    from vllm_kvreuse.core.upstream import Upstream


@dataclass(slots=True)
class Seat:
    """A running request's computed state: what a re-seat copies.

    ``tokens`` all have KV (the request's sampled last token is not part of
    it); ``blocks[g]`` cover them in KV-cache group ``g``; ``block_hashes``
    are the hashes of the full hash blocks of ``tokens``.
    """

    tokens: list[int]
    blocks: tuple[list[Any], ...]
    block_hashes: list[Any]
    num_cached: tuple[int, ...]


@dataclass(slots=True)
class Move:
    """Re-seat ``request`` onto ``seat`` (None: its own computed state) with
    ``token`` as its next input; ``sampling_params``, if given, replace its
    own (a catalog beam's trie node changes every step)."""

    request: Request
    seat: Seat | None
    token: int
    sampling_params: SamplingParams | None = None


class Reseats:
    """Re-seats of running requests, and their delivery to the workers."""

    def __init__(self, upstream: Upstream) -> None:
        self._upstream = upstream
        self.block_size = upstream.block_size
        self._hash_block_size = upstream.hash_block_size
        self.pending: set[str] = set()
        """Re-seated requests whose workers have not been told yet."""
        self.num_moved = 0
        self.num_copied_blocks = 0

    def seat_of(self, request: Request) -> Seat:
        """``request``'s computed tokens and the blocks holding them."""
        num_computed = min(request.num_computed_tokens, request.num_tokens - 1)
        num_blocks = -(-num_computed // self.block_size)
        return Seat(
            tokens=list(request.all_token_ids[:num_computed]),
            blocks=self._upstream.table(request.request_id, num_blocks),
            block_hashes=list(
                request.block_hashes[: num_computed // self._hash_block_size]
            ),
            num_cached=self._upstream.num_cached(request.request_id, num_blocks),
        )

    def move(self, moves: list[Move]) -> None:
        """Applies one step's re-seats; every ``Seat`` must have been read
        before the first call that changes a request it came from.

        Needs one free block per moved request whose seat ends inside a
        block; the blocks of the moved requests' old tables are freed first,
        and each of those ends in a private tail, so a batch that replaces
        requests whose beams died always fits. Raises ``RuntimeError`` (and
        changes nothing) when the pool cannot cover it.
        """
        upstream = self._upstream
        foreign = [m for m in moves if m.seat is not None]
        bs = self.block_size
        num_cows = sum(bool(len(m.seat.tokens) % bs) for m in foreign)  # type: ignore[union-attr]
        # 1. Reference what the new tables share before anything is freed, so
        #    a block the old and new tables share never reaches the free queue.
        for m in foreign:
            assert m.seat is not None
            assert len(m.seat.blocks) == upstream.num_groups, "a seat per group"
            num_full = len(m.seat.tokens) // bs
            for group in m.seat.blocks:
                upstream.reference(group[:num_full])
                if len(group) > num_full:  # the copy source, retained
                    upstream.reference(group[num_full : num_full + 1])
        # 2. The old tables go.
        for m in foreign:
            upstream.drop_tables(m.request.request_id)
        if upstream.num_free_blocks() < num_cows * upstream.num_groups:
            raise RuntimeError(
                f"re-seat needs {num_cows} free blocks per KV-cache group, "
                f"the pool has {upstream.num_free_blocks()}"
            )
        # 3. New tables: shared full blocks, a private copy of the tail.
        for m in foreign:
            assert m.seat is not None
            num_full = len(m.seat.tokens) // bs
            for g, (group, cached) in enumerate(
                zip(m.seat.blocks, m.seat.num_cached, strict=True)
            ):
                table = list(group[:num_full])
                if len(group) > num_full:
                    table.append(upstream.copy_tail(g, group[num_full]))
                    self.num_copied_blocks += 1
                upstream.set_table(
                    g, m.request.request_id, table, min(cached, num_full)
                )
        # 4. Tokens, hashes, params.
        for m in moves:
            self._retoken(m)
            self.pending.add(m.request.request_id)
        self.num_moved += len(foreign)

    def _retoken(self, m: Move) -> None:
        seat = m.seat or self.seat_of(m.request)
        self._upstream.retoken(
            m.request,
            [*seat.tokens, m.token],
            len(seat.tokens),
            seat.block_hashes,
            m.sampling_params,
        )

    def deliver(self, output: SchedulerOutput) -> None:
        """Sends each scheduled re-seated request to its workers as a
        streaming update (a ``NewRequestData`` for an id they know)."""
        if self.pending:
            self.pending -= self._upstream.send_whole(output, self.pending)

    def resend(self, request_id: str) -> None:
        """The workers' copy of a running request is stale (a feature moved
        its computed count): send it whole the next time it is scheduled."""
        self.pending.add(request_id)

    def copies_queued(self) -> bool:
        """Tail copies wait for the next ``schedule()``, which drains them
        and drops their endpoints' extra references."""
        return self._upstream.copies_queued()

    def cancel_copies(self) -> None:
        """Drops the queued tail copies and their extra references. Only
        when every running request is being preempted (a full prefix-cache
        reset): their KV is recomputed, so the copies are moot."""
        self._upstream.cancel_copies()

    def forget(self, request_id: str) -> None:
        self.pending.discard(request_id)
