"""The chunk store's index: what is stored where, LRU order, pins, capacity.

The index lives with the scheduler and decides everything: which chunk goes
in, which moves down a tier or out. Workers hold the bytes and apply its
decisions in order (:class:`StoreOp`), so both sides always agree on what
is stored without a round trip. Only :class:`~.store.ChunkStore` changes it.

Tiers, fastest first: ``device`` (the KV cache's device, memory on top of
it), ``cpu`` (host memory), ``disk`` (files that outlive the server) and
``remote`` (a store shared by servers, :mod:`..tiers.shared`). One LRU order runs
across the local tiers: a tier that needs room moves its least recently
used unpinned chunks to the next tier down (device -> cpu -> disk), and
evicts them where there is none. A chunk used again moves back up to the
device tier (:meth:`ChunkIndex.promote`). The shared store is written
through on save and sizes itself; the index only remembers which of its
chunks it knows of, at no local cost.

Invariants:
- ``used[tier]`` is the sum of ``nbytes`` of the tier's entries and never
  exceeds its capacity (the remote tier is not counted).
- A pinned entry (``pins > 0``) never moves down or out: a request that
  will load it, or the request computing it, holds a pin.
- An entry is *reserved* (``ready`` False) from the moment a request plans
  to compute it in place until that request's save is sent to the workers;
  it counts against capacity and cannot be loaded yet. Its ``owner`` is
  that request.
- ``shared``: the chunk is (or is being written) in the shared store too.
- Chunks known only in the shared store are not entries but ``remote``
  records (key -> meta, at most :data:`REMOTE_KNOWN`): making room never
  walks them. A request that loads one lifts it into an entry
  (:meth:`ChunkIndex.lift`); an unpinned entry still in the shared store
  only sinks back (:meth:`ChunkIndex.sink`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from vllm_kvreuse.chunk_cache.engine.keys import ChunkKey, Origin
from vllm_kvreuse.chunk_cache.engine.stats import StoreStats
from vllm_kvreuse.chunk_cache.messages import StoreOp, Tier
from vllm_kvreuse.chunk_cache.tiers.codec import Meta

LOCAL_TIERS: tuple[Tier, ...] = ("device", "cpu", "disk")
BELOW: dict[Tier, Tier] = {"device": "cpu", "cpu": "disk"}
"""Where a chunk goes when its tier needs room (else it is evicted)."""
FORGET_AFTER = 8192
"""Evicted keys remembered, to tell a store too small for its workload."""
REMOTE_KNOWN = 1 << 17
"""Chunks of the shared store remembered (least recently used forgotten):
they cost no local room, only this bound's memory, and are never walked."""


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
    shared: bool = False

    @property
    def meta(self) -> Meta:
        return Meta(self.num_tokens, self.start, self.origin)


@dataclass(slots=True)
class ChunkIndex:
    """One LRU index over the tiers, sized in bytes."""

    capacity: dict[Tier, int]
    bytes_per_token: int
    entries: OrderedDict[ChunkKey, Entry] = field(default_factory=OrderedDict)
    used: dict[Tier, int] = field(default_factory=lambda: dict.fromkeys(LOCAL_TIERS, 0))
    pending_ops: list[StoreOp] = field(default_factory=list)
    stats: StoreStats = field(default_factory=StoreStats)
    num_pinned: int = 0  # entries with pins > 0, kept as pins change
    evicted: OrderedDict[ChunkKey, float] = field(default_factory=OrderedDict)
    remote: OrderedDict[ChunkKey, Meta] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        for tier in LOCAL_TIERS:  # a tier not given has no room
            self.capacity.setdefault(tier, 0)

    def get(self, key: ChunkKey) -> Entry | None:
        return self.entries.get(key)

    def knows(self, key: ChunkKey) -> bool:
        """Stored in some tier (the shared store's included), or reserved."""
        return key in self.entries or key in self.remote

    def lift(self, key: ChunkKey) -> Entry | None:
        """The entry of a chunk known only in the shared store (made one:
        a request is about to load it); None if it is not known there."""
        meta = self.remote.pop(key, None)
        if meta is None:
            return None
        entry = Entry(
            meta.num_tokens, meta.num_tokens * self.bytes_per_token, meta.start,
            meta.origin, owner="", tier="remote", ready=True, shared=True,
        )  # fmt: skip
        self.entries[key] = entry
        return entry

    def sink(self, key: ChunkKey) -> None:
        """An unpinned entry left only in the shared store goes back to
        being a remote record."""
        entry = self.entries.get(key)
        if entry is not None and entry.tier == "remote" and not entry.pins:
            del self.entries[key]
            self._remember_remote(key, entry.meta)

    def _remember_remote(self, key: ChunkKey, meta: Meta) -> None:
        self.remote[key] = meta
        self.remote.move_to_end(key)
        while len(self.remote) > REMOTE_KNOWN:
            self.remote.popitem(last=False)

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
        return sum(self.used.values()) // self.bytes_per_token

    def reserve(
        self, key: ChunkKey, num_tokens: int, start: int, origin: Origin, owner: str
    ) -> bool:
        """Makes room on the device tier and adds ``key`` (pinned, not ready).

        False, changing nothing, when the chunk cannot fit: larger than the
        tier, or everything else there pinned.
        """
        nbytes = num_tokens * self.bytes_per_token
        if not self._make_room("device", nbytes):
            self.stats.refused += 1
            return False
        self.entries[key] = Entry(
            num_tokens, nbytes, start=start, origin=origin, owner=owner, pins=1
        )
        self.num_pinned += 1
        self.used["device"] += nbytes
        return True

    def add(self, key: ChunkKey, meta: Meta, tier: Tier) -> bool:
        """Records a ready chunk found on disk at start-up, or in the shared
        store (``remote``: a record, not counted locally). False where it
        does not fit."""
        if tier == "remote":
            if key not in self.entries:
                self._remember_remote(key, meta)
            return True
        nbytes = meta.num_tokens * self.bytes_per_token
        if self.used[tier] + nbytes > self.capacity[tier]:
            return False
        self.entries[key] = Entry(
            meta.num_tokens, nbytes, meta.start, meta.origin, owner="", tier=tier,
            ready=True,
        )  # fmt: skip
        self.entries.move_to_end(key, last=False)  # least recently used
        self.used[tier] += nbytes
        return True

    def promote(self, key: ChunkKey) -> bool:
        """Moves a stored (and pinned) chunk up to the device tier, making
        room there; False, changing nothing, where there is none."""
        entry = self.entries[key]
        source = entry.tier
        if source == "device":
            return True
        # Its place below is free for what moves down to make room for it.
        if source != "remote":
            self.used[source] -= entry.nbytes
        entry.tier = "remote"
        if not self._make_room("device", entry.nbytes):  # moved nothing
            entry.tier = source
            if source != "remote":
                self.used[source] += entry.nbytes
            return False
        self.used["device"] += entry.nbytes
        self.pending_ops.append(StoreOp("move", key, source, "device", entry.meta))
        entry.tier = "device"
        return True

    def mark_ready(self, key: ChunkKey) -> None:
        self.entries[key].ready = True

    def drop(self, key: ChunkKey) -> None:
        """Forgets ``key`` (a chunk whose computing request ended before
        saving it, or whose bytes could not be read); workers evict it."""
        self.remote.pop(key, None)
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.num_pinned -= entry.pins > 0
            if entry.tier != "remote":
                self.used[entry.tier] -= entry.nbytes
            self.pending_ops.append(StoreOp("evict", key, meta=entry.meta))

    def clear(self) -> int:
        """Evicts every unpinned entry; returns how many."""
        victims = [key for key, entry in self.entries.items() if not entry.pins]
        for key in victims:
            self._evict(key, forget_shared=True)
        forgotten = len(self.remote)
        self.remote.clear()
        return len(victims) + forgotten

    def take_ops(self) -> list[StoreOp]:
        ops, self.pending_ops = self.pending_ops, []
        return ops

    def bytes_in(self, tier: Tier) -> int:
        return self.used[tier]

    def was_evicted(self, key: ChunkKey, within: float) -> bool:
        """Whether ``key`` left the store in the last ``within`` seconds."""
        when = self.evicted.pop(key, None)
        return when is not None and time.monotonic() - when <= within

    def _make_room(self, tier: Tier, nbytes: int) -> bool:
        """Frees ``nbytes`` on ``tier`` by moving its least recently used
        unpinned ready chunks down (or out); False, moving nothing, when
        they are not enough."""
        if nbytes > self.capacity[tier]:
            return False
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
            below = self._below(tier)
            entry = self.entries[key]
            if below is not None and self._make_room(below, entry.nbytes):
                self._place(key, entry, below)
            else:
                self._evict(key)
        return True

    def _below(self, tier: Tier) -> Tier | None:
        """The next tier down that has room at all (a CPU tier of size 0 is
        skipped: the device tier then moves chunks to disk)."""
        below = BELOW.get(tier)
        while below is not None and not self.capacity[below]:
            below = BELOW.get(below)
        return below

    def _place(self, key: ChunkKey, entry: Entry, tier: Tier) -> None:
        self.stats.demoted += (entry.tier, tier) == ("device", "cpu")
        self.stats.spilled += tier == "disk"
        if entry.tier != "remote":
            self.used[entry.tier] -= entry.nbytes
        self.used[tier] += entry.nbytes
        self.pending_ops.append(StoreOp("move", key, entry.tier, tier, entry.meta))
        entry.tier = tier

    def _evict(self, key: ChunkKey, forget_shared: bool = False) -> None:
        """Out of the local tiers; a chunk the shared store holds stays
        known there (unless ``forget_shared``)."""
        entry = self.entries[key]
        if entry.tier != "remote":
            self.used[entry.tier] -= entry.nbytes
            self.stats.evictions += 1
            self.pending_ops.append(StoreOp("evict", key, meta=entry.meta))
            self.evicted[key] = time.monotonic()
            while len(self.evicted) > FORGET_AFTER:
                self.evicted.popitem(last=False)
        del self.entries[key]
        if entry.shared and not forget_shared:
            self._remember_remote(key, entry.meta)
