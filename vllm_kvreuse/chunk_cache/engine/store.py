"""The chunk store's owner, in the engine core: keys, pins, reservations.

:class:`ChunkStore` is the only code that changes the
:class:`~.index.ChunkIndex`: the planner (:mod:`.planner`) asks it to
pin, reserve and mark saved; the connector asks it to clear; the admin
endpoint runs :meth:`ChunkStore.admin`. Workers hold the tensors and apply
the index's decisions in order (:meth:`take_ops`).

Pins: a plan holds one pin on each chunk it loads, from planning until its
last load is built; a reservation holds one pin for the request computing
the chunk, until its save is built (:meth:`saved`) or it ends without one
(:meth:`abandon`); an admin pin holds one until unpinned.

Tiers (:mod:`.index`): a chunk about to be loaded moves up to the device
tier (:meth:`ChunkStore.prepare_load`); a saved chunk is also written to the
shared store when one is set (:meth:`saved`); chunks the shared store holds
are looked up once per request, for the chunks not held locally
(:meth:`lookup_shared`). A read that failed drops its chunk (:meth:`lost`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from vllm.logger import init_logger

from vllm_kvreuse.chunk_cache.engine.index import (
    LOCAL_TIERS,
    ChunkIndex,
    Entry,
    StoreOp,
    Tier,
)
from vllm_kvreuse.chunk_cache.engine.keys import ChunkKey, Origin, chunk_key
from vllm_kvreuse.chunk_cache.engine.stats import COUNTERS
from vllm_kvreuse.chunk_cache.tiers.shared import SharedStore
from vllm_kvreuse.chunk_cache.tiers.urls import redact_url

logger = init_logger(__name__)

THRASH_WINDOW = 300.0
"""A chunk asked for within this many seconds of its eviction counts as
thrashing (``vllm_kvreuse:chunk_cache_thrashed``)."""
TOO_SMALL_HINT = (
    "raise --chunk-cache-cpu-gib, or set --chunk-cache-disk-path (and "
    "--chunk-cache-disk-gib)"
)


class ChunkStore:
    """What is stored, pinned and reserved; the index's sole owner."""

    def __init__(
        self,
        index: ChunkIndex,
        hasher: Callable[[Any], bytes],
        identity: tuple[str, ...],
        shared: SharedStore | None = None,
    ) -> None:
        self.index = index
        self.stats = index.stats
        self._hasher = hasher
        self.identity = identity
        self.shared = shared
        self._admin_pins: set[ChunkKey] = set()
        self._warned_at = -THRASH_WINDOW

    def key(self, cache_salt: str | None, lora_name: str, tokens: Any) -> ChunkKey:
        """The content key of ``tokens`` for a request's salt and adapter."""
        salt = f"{cache_salt or ''}|{lora_name}"
        return chunk_key(self._hasher, self.identity, salt, tokens)

    def stored(self, key: ChunkKey) -> Entry | None:
        """The entry of ``key`` if its KV is stored (not merely reserved)."""
        entry = self.index.get(key)
        return entry if entry is not None and entry.ready else None

    def is_known(self, key: ChunkKey) -> bool:
        """Stored (the shared store included), or reserved by a request
        computing it now."""
        return self.index.knows(key)

    def hold(self, key: ChunkKey) -> Entry | None:
        """The stored chunk ``key``, pinned and moved up to the device tier
        for a load; None (nothing held) where it is not stored, or cannot
        be brought up now. The caller gives the pin back with
        :meth:`let_go` and this entry."""
        entry = self.stored(key) or self.index.lift(key)
        if entry is None:
            return None
        self.index.pin(key)
        if self.prepare_load(key) is None:
            self.let_go([(key, entry)])
            return None
        return entry

    def let_go(self, held: Iterable[tuple[ChunkKey, Entry]]) -> None:
        """Gives back pins taken by :meth:`hold`: each only while its entry
        is still the one pinned (a chunk lost and stored again since is
        another entry, whose pins are its own requests')."""
        for key, entry in held:
            if self.index.get(key) is entry:
                self.index.unpin(key)
                self.index.sink(key)

    def lookup_shared(self, keys: Iterable[ChunkKey]) -> None:
        """Records which of ``keys`` (those not known locally) the shared
        store holds: they load from there (one round trip)."""
        if self.shared is None or not self.shared.available:
            return
        unknown = [key for key in dict.fromkeys(keys) if not self.index.knows(key)]
        for key, meta in self.shared.lookup(unknown).items():
            self.index.add(key, meta, "remote")

    def prepare_load(self, key: ChunkKey) -> Tier | None:
        """The tier the stored, pinned ``key`` was found in, after moving it
        up to the device tier for its load; None where it cannot be loaded
        now (on disk or in the shared store, and no room on the device)."""
        entry = self.index.entries[key]
        found = entry.tier
        if not self.index.promote(key) and found in ("disk", "remote"):
            return None
        self.stats.device_hits += found == "device"
        self.stats.cpu_hits += found == "cpu"
        self.stats.disk_hits += found == "disk"
        self.stats.remote_hits += found == "remote"
        return found

    def note_miss(self, key: ChunkKey) -> None:
        """A chunk not in the store: thrashing if it was evicted lately
        (counted, and said in the log at most once a window)."""
        if not self.index.was_evicted(key, THRASH_WINDOW):
            return
        self.stats.thrashed += 1
        now = time.monotonic()
        if now - self._warned_at >= THRASH_WINDOW:
            self._warned_at = now
            logger.warning(
                "chunk cache: chunks evicted in the last %.0f s are asked for "
                "again (%d so far): the store is too small for this workload; "
                "%s", THRASH_WINDOW, self.stats.thrashed, TOO_SMALL_HINT,
            )  # fmt: skip

    def lost(self, keys: Iterable[ChunkKey]) -> None:
        """Chunks whose bytes a worker could not read: forgotten at once,
        pinned or not, so that the next request that wants one computes and
        stores it again. Requests that planned to load one fail that load
        and compute it (a worker loads only the bytes a plan names), and
        their pins die with the entry (:meth:`let_go`). A reserved entry
        has no bytes to lose: it stays its owner's."""
        for key in keys:
            self.stats.load_failures += 1
            entry = self.index.get(key)
            if entry is None or entry.ready:
                self.index.drop(key)

    # -- pins and reservations -------------------------------------------------

    def pin(self, keys: Iterable[ChunkKey]) -> None:
        for key in keys:
            self.index.pin(key)

    def unpin(self, keys: Iterable[ChunkKey]) -> None:
        for key in keys:
            self.index.unpin(key)

    def reserve(
        self, key: ChunkKey, length: int, start: int, origin: Origin, owner: str
    ) -> bool:
        """Room for ``key``, computed in place by ``owner`` at ``start``;
        False (nothing changed, counted as refused) if the store is full of
        pinned chunks or the chunk is larger than the device tier."""
        return self.index.reserve(key, length, start, origin, owner)

    def saved(self, key: ChunkKey) -> None:
        """The owner's save of ``key`` goes to the workers this step: the
        chunk is stored from then on, and its reservation pin is dropped."""
        entry = self.index.entries[key]
        self.index.mark_ready(key)
        self.index.unpin(key)
        self.stats.saved += 1
        if self.shared is not None and not entry.shared:
            entry.shared = True
            self.index.pending_ops.append(StoreOp("publish", key, meta=entry.meta))
            self.stats.published += 1

    def abandon(self, key: ChunkKey, owner: str) -> None:
        """``owner`` ends without saving ``key``: its reservation goes."""
        entry = self.index.get(key)
        if entry is not None and not entry.ready and entry.owner == owner:
            self.index.drop(key)

    def take_ops(self) -> list[StoreOp]:
        return self.index.take_ops() if self.index.pending_ops else []

    # -- admin -----------------------------------------------------------------

    def clear(self) -> int:
        """Evicts every unpinned chunk; returns how many."""
        return self.index.clear()

    def admin(
        self,
        action: str,
        token_ids: list[int] | None = None,
        cache_salt: str | None = None,
    ) -> dict[str, Any]:
        """The admin endpoint's actions: ``stats``, ``clear``, ``pin`` and
        ``unpin`` (a stored chunk by its token ids and ``cache_salt``; an
        admin pin is counted once however often it is asked)."""
        if action == "clear":
            return {"evicted": self.clear()}
        if action == "stats":
            return self.summary()
        if action not in ("pin", "unpin"):
            raise ValueError(f"unknown chunk-cache action {action!r}")
        if not token_ids:
            raise ValueError("token_ids must list the chunk's token ids")
        key = self.key(cache_salt, "", token_ids)
        entry = self.stored(key)
        if entry is None:
            return {"found": False}
        if action == "pin" and key not in self._admin_pins:
            self._admin_pins.add(key)
            self.index.pin(key)
        elif action == "unpin" and key in self._admin_pins:
            self._admin_pins.discard(key)
            self.index.unpin(key)
        return {"found": True, "pinned": entry.pins > 0}

    def gauges(self) -> dict[str, int]:
        """Current gauges (O(1): read every step)."""
        index = self.index
        return {
            "chunks": len(index.entries),
            "stored_tokens": index.stored_tokens,
            "pinned": index.num_pinned,
            "device_bytes": index.bytes_in("device"),
            "cpu_bytes": index.bytes_in("cpu"),
            "disk_bytes": index.bytes_in("disk"),
        }

    def summary(self) -> dict[str, Any]:
        """Counters, gauges, hit rate and capacities (the admin ``stats``)."""
        counts = {name: getattr(self.stats, name) for name in COUNTERS}
        looked_up = counts["hits"] + counts["misses"]
        return {
            **counts,
            **self.gauges(),
            "hit_rate": counts["hits"] / looked_up if looked_up else 0.0,
            **{
                f"{tier}_capacity_bytes": self.index.capacity[tier]
                for tier in LOCAL_TIERS
            },
            "shared_store": (
                redact_url(self.shared.url) if self.shared is not None else None
            ),
        }
