"""The chunk store: its LRU index over the tiers, its owner's pins and
reservations, and the origins and salts that keep loads and prefix caching
exact."""

from __future__ import annotations

from vllm_kvreuse.chunk_cache.engine.index import ChunkIndex
from vllm_kvreuse.chunk_cache.engine.keys import Provenance
from vllm_kvreuse.chunk_cache.engine.store import ChunkStore

IDENTITY = ("model", "", "auto", "float32", "in-place")


def reserve(store: ChunkIndex, key: bytes, tokens: int, owner: str = "r") -> bool:
    return store.reserve(key, tokens, 0, b"", owner)


def index(device_tokens: int, cpu_tokens: int = 0) -> ChunkIndex:
    return ChunkIndex(
        capacity={"device": device_tokens, "cpu": cpu_tokens}, bytes_per_token=1
    )


def ready(store: ChunkIndex, key: bytes, tokens: int) -> None:
    assert store.reserve(key, tokens, 0, b"", "r")
    store.mark_ready(key)
    store.unpin(key)


def test_least_recently_used_unpinned_chunk_goes_first() -> None:
    store = index(100)
    ready(store, b"a", 40)
    ready(store, b"b", 40)
    store.touch(b"a")
    assert reserve(store, b"c", 40)
    assert store.get(b"b") is None and store.get(b"a") is not None
    assert [(op.kind, op.key) for op in store.take_ops()] == [("evict", b"b")]
    assert store.bytes_in("device") == 80


def test_device_evictions_are_demoted_when_the_cpu_tier_has_room() -> None:
    store = index(50, cpu_tokens=50)
    ready(store, b"a", 40)
    assert reserve(store, b"b", 40)
    assert store.get(b"a").tier == "cpu"
    moves = [(op.kind, op.key, op.source, op.target) for op in store.take_ops()]
    assert moves == [("move", b"a", "device", "cpu")]


def test_pinned_or_oversized_chunks_are_refused_without_changes() -> None:
    store = index(50)
    ready(store, b"a", 40)
    store.pin(b"a")
    assert not reserve(store, b"b", 20)  # a is pinned
    assert not reserve(store, b"c", 60)  # larger than the tier
    assert store.get(b"a") is not None and not store.take_ops()
    assert store.stats.refused == 2
    assert store.num_pinned == 1 and store.stored_tokens == 40
    store.unpin(b"a")
    assert store.num_pinned == 0
    assert store.clear() == 1 and store.bytes_in("device") == 0


def test_a_reservation_goes_with_its_owner_and_only_its_owner() -> None:
    index = ChunkIndex(capacity={"device": 100, "cpu": 0}, bytes_per_token=1)
    store = ChunkStore(index, hash, IDENTITY)
    assert store.reserve(b"a", 10, 5, b"o", "first")
    store.abandon(b"a", "second")  # not its reservation
    assert store.is_known(b"a") and store.stored(b"a") is None
    store.abandon(b"a", "first")
    assert not store.is_known(b"a") and index.num_pinned == 0
    assert store.reserve(b"a", 10, 5, b"o", "first")
    store.saved(b"a")
    store.abandon(b"a", "first")  # saved: stays
    entry = store.stored(b"a")
    assert entry is not None and entry.start == 5 and entry.origin == b"o"
    assert entry.pins == 0 and store.stats.saved == 1


def test_an_origin_names_the_tokens_before_a_chunk_and_their_values() -> None:
    """Equal prefixes and provenance give equal origins; another prefix,
    salt or an approximate load before the chunk gives another."""

    def origin_after(salt, tokens, moved=None):
        walk = Provenance(salt, IDENTITY)
        walk.feed(tokens)
        if moved is not None:
            walk.loaded_approximately(len(tokens), 3, moved, [])
        return walk.origin(b"key")

    assert origin_after(None, [1, 2]) == origin_after(None, [1, 2])
    assert origin_after(None, [1, 2]) != origin_after(None, [1, 3])
    assert origin_after(None, [1, 2]) != origin_after("tenant", [1, 2])
    assert origin_after(None, [1, 2], b"x") != origin_after(None, [1, 2])
    assert origin_after(None, [1, 2], b"x") != origin_after(None, [1, 2], b"y")


def test_only_a_request_holding_moved_kv_is_salted() -> None:
    """Exact KV keeps the request's own salt (shared with ordinary requests
    both ways); a moved chunk salts it, naming that chunk's origin and the
    positions recomputed in it."""
    exact = Provenance("tenant", IDENTITY)
    exact.feed([1, 2, 3])
    assert exact.block_salt() == "tenant"
    assert Provenance(None, IDENTITY).block_salt() is None

    def salt(origin: bytes, spans: list) -> str | None:
        walk = Provenance("tenant", IDENTITY)
        walk.loaded_approximately(0, 4, origin, spans)
        return walk.block_salt()

    assert salt(b"x", []).startswith("kvreuse-chunks/")
    assert salt(b"x", []).endswith("/tenant")
    assert salt(b"x", []) == salt(b"x", [])
    assert salt(b"x", []) != salt(b"y", [])
    assert salt(b"x", []) != salt(b"x", [(0, 2)])
