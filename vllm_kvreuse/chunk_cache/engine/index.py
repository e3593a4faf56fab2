"""The chunk store's index: what is stored where, LRU order, pins, capacity.

The index lives with the scheduler and decides everything: which chunk goes
in, which is demoted to the CPU tier or evicted. Workers hold the tensors and
apply its decisions in order (:class:`StoreOp`), so both sides always agree
on what is stored without a round trip. Only :class:`~.store.ChunkStore`
changes it.

Invariants:
- ``used[tier]`` is the sum of ``nbytes`` of the tier's entries and never
  exceeds its capacity.
- A pinned entry (``pins > 0``) is never demoted or evicted: a request that
  will load it, or the request computing it, holds a pin.
- An entry is *reserved* (``ready`` False) from the moment a request plans
  to compute it in place until that request's save is sent to the workers;
  it counts against capacity and cannot be loaded yet. Its ``owner`` is
  that request.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

from vllm_kvreuse.chunk_cache.engine.keys import ChunkKey, Origin

Tier = Literal["device", "cpu"]


@dataclass(slots=True)
class Entry:
    """A stored chunk: ``start`` is the position it was computed at and
    ``origin`` names its values (:mod:`.keys`); ``owner`` is the request
    computing it while it is reserved."""

    num_tokens: int
    nbytes: int
    start: int
    origin: Origin
    owner: str
    tier: Tier = "device"
    pins: int = 0
    ready: bool = False


@dataclass(frozen=True, slots=True)
class StoreOp:
    """A decision for the workers: ``demote`` to the CPU tier, or ``evict``."""

    kind: Literal["demote", "evict"]
    key: ChunkKey


def _count(doc: str) -> Any:
    """A :class:`StoreStats` field: a total from 0, ``doc`` its help."""
    return field(default=0, metadata={"doc": doc})


@dataclass(slots=True)
class StoreStats:
    """Chunk-cache counters (totals): each is ``vllm_kvreuse:chunk_cache_<name>``
    in ``/metrics`` with its doc as help (``stats.COUNTERS``)."""

    hits: int = _count("Chunks of arriving requests found in the chunk store.")
    misses: int = _count(
        "Chunks of arriving requests not in the chunk store: computed in place."
    )
    hit_tokens: int = _count("Prompt tokens of chunks found in the chunk store.")
    miss_tokens: int = _count("Prompt tokens of chunks computed in place.")
    exact_hits: int = _count(
        "Chunks found stored as computed after the same tokens: loaded as "
        "full attention computes them."
    )
    saved: int = _count("Chunks computed in place and stored.")
    evictions: int = _count("Chunks evicted from the chunk store (LRU or clear).")
    refused: int = _count(
        "Chunks the store could not take (too large, or all pinned): "
        "computed in place and not stored."
    )


@dataclass(slots=True)
class ChunkIndex:
    """LRU index over two tiers, sized in bytes."""

    capacity: dict[Tier, int]
    bytes_per_token: int
    entries: OrderedDict[ChunkKey, Entry] = field(default_factory=OrderedDict)
    used: dict[Tier, int] = field(default_factory=lambda: {"device": 0, "cpu": 0})
    pending_ops: list[StoreOp] = field(default_factory=list)
    stats: StoreStats = field(default_factory=StoreStats)
    num_pinned: int = 0  # entries with pins > 0, kept as pins change

    def get(self, key: ChunkKey) -> Entry | None:
        return self.entries.get(key)

    def touch(self, key: ChunkKey) -> None:
        self.entries.move_to_end(key)

    def pin(self, key: ChunkKey) -> None:
        entry = self.entries[key]
        self.num_pinned += entry.pins == 0
        entry.pins += 1
        self.touch(key)

    def unpin(self, key: ChunkKey) -> None:
        entry = self.entries.get(key)
        if entry is not None and entry.pins > 0:
            entry.pins -= 1
            self.num_pinned -= entry.pins == 0

    @property
    def stored_tokens(self) -> int:
        return (self.used["device"] + self.used["cpu"]) // self.bytes_per_token

    def reserve(
        self, key: ChunkKey, num_tokens: int, start: int, origin: Origin, owner: str
    ) -> bool:
        """Makes room on the device tier and adds ``key`` (pinned, not ready).

        Demotes (or, without room on the CPU tier, evicts) least recently
        used unpinned entries. False, changing nothing, when the chunk cannot
        fit: larger than the tier, or everything else pinned.
        """
        nbytes = num_tokens * self.bytes_per_token
        if nbytes > self.capacity["device"] or not self._make_room("device", nbytes):
            self.stats.refused += 1
            return False
        self.entries[key] = Entry(
            num_tokens, nbytes, start=start, origin=origin, owner=owner, pins=1
        )
        self.num_pinned += 1
        self.used["device"] += nbytes
        return True

    def mark_ready(self, key: ChunkKey) -> None:
        self.entries[key].ready = True

    def drop(self, key: ChunkKey) -> None:
        """Forgets ``key`` (a chunk whose computing request ended before
        saving it); workers evict it."""
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.num_pinned -= entry.pins > 0
            self.used[entry.tier] -= entry.nbytes
            self.pending_ops.append(StoreOp("evict", key))

    def clear(self) -> int:
        """Evicts every unpinned entry; returns how many."""
        victims = [key for key, entry in self.entries.items() if not entry.pins]
        for key in victims:
            self._evict(key)
        return len(victims)

    def take_ops(self) -> list[StoreOp]:
        ops, self.pending_ops = self.pending_ops, []
        return ops

    def bytes_in(self, tier: Tier) -> int:
        return self.used[tier]

    def _make_room(self, tier: Tier, nbytes: int) -> bool:
        free = self.capacity[tier] - self.used[tier]
        if free >= nbytes:
            return True
        victims = []
        for key, entry in self.entries.items():  # least recently used first
            if entry.tier == tier and not entry.pins and entry.ready:
                victims.append(key)
                free += entry.nbytes
                if free >= nbytes:
                    break
        if free < nbytes:
            return False
        for key in victims:
            if tier == "device" and self._fits_cpu(self.entries[key].nbytes):
                self._demote(key)
            else:
                self._evict(key)
        return True

    def _fits_cpu(self, nbytes: int) -> bool:
        return nbytes <= self.capacity["cpu"] and self._make_room("cpu", nbytes)

    def _demote(self, key: ChunkKey) -> None:
        entry = self.entries[key]
        self.used["device"] -= entry.nbytes
        self.used["cpu"] += entry.nbytes
        entry.tier = "cpu"
        self.pending_ops.append(StoreOp("demote", key))

    def _evict(self, key: ChunkKey) -> None:
        entry = self.entries.pop(key)
        self.used[entry.tier] -= entry.nbytes
        self.stats.evictions += 1
        self.pending_ops.append(StoreOp("evict", key))
