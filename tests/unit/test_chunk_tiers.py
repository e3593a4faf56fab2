"""The chunk store's tiers: the index's moves across device, CPU, disk and the
shared store; the blob format; the disk tier's files and restart; a
worker's tiers moving real tensors through them, bit for bit, and what they
do when a tier fails (a real Valkey server for the shared store)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from vllm_kvreuse.chunk_cache.engine.index import ChunkIndex
from vllm_kvreuse.chunk_cache.engine.store import ChunkStore
from vllm_kvreuse.chunk_cache.tiers.codec import CorruptChunk, Meta, decode, encode
from vllm_kvreuse.chunk_cache.tiers.disk import DiskFiles
from vllm_kvreuse.chunk_cache.tiers.shared import SharedStore
from vllm_kvreuse.chunk_cache.worker.tiers import LocalTiers

IDENTITY = ("model", "", "auto", "float32", "in-place")
META = Meta(8, 3, b"origin")


def index(device: int, cpu: int = 0, disk: int = 0) -> ChunkIndex:
    return ChunkIndex({"device": device, "cpu": cpu, "disk": disk}, bytes_per_token=1)


def ready(store: ChunkIndex, key: bytes, tokens: int) -> None:
    assert store.reserve(key, tokens, 0, b"o", "r")
    store.mark_ready(key)
    store.unpin(key)


def moves(store: ChunkIndex) -> list[tuple]:
    return [(op.kind, op.key, op.source, op.target) for op in store.take_ops()]


def test_room_is_made_down_the_tiers_and_evicted_at_the_bottom() -> None:
    store = index(device=40, cpu=40, disk=40)
    for key in (b"a", b"b", b"c", b"d"):
        ready(store, key, 40)
    # a went device -> cpu -> disk, b device -> cpu, c device; d evicts a.
    assert [store.get(k).tier for k in (b"b", b"c", b"d")] == ["disk", "cpu", "device"]
    assert store.get(b"a") is None
    assert ("evict", b"a", None, None) in moves(store)
    assert store.used == {"device": 40, "cpu": 40, "disk": 40}
    assert store.stats.demoted == 3 and store.stats.spilled == 2


def test_a_chunk_used_again_moves_up_and_pushes_the_coldest_down() -> None:
    store = index(device=40, cpu=40, disk=40)
    for key in (b"a", b"b", b"c"):
        ready(store, key, 40)
    moves(store)
    store.pin(b"a")  # a load pins first
    assert store.promote(b"a")
    assert moves(store) == [
        ("move", b"b", "cpu", "disk"),  # room in the CPU tier first
        ("move", b"c", "device", "cpu"),
        ("move", b"a", "disk", "device"),
    ]
    assert store.get(b"a").tier == "device" and store.get(b"b").tier == "disk"


def test_a_spill_carries_the_meta_and_skips_a_cpu_tier_that_is_off() -> None:
    store = index(device=10, cpu=0, disk=10)
    assert store.reserve(b"a", 10, 5, b"origin", "r")
    store.mark_ready(b"a")
    store.unpin(b"a")
    ready(store, b"b", 10)
    (op,) = [op for op in store.take_ops() if op.target == "disk"]
    assert op.meta == Meta(10, 5, b"origin")


def test_shared_chunks_stay_known_after_they_leave_the_local_tiers() -> None:
    idx = index(device=10)
    store = ChunkStore(idx, hash, IDENTITY)
    assert idx.add(b"s", Meta(10, 0, b"o"), "remote")
    assert idx.used["device"] == 0 and store.is_known(b"s")
    entry = store.hold(b"s")
    assert entry is not None and store.stats.remote_hits == 1
    assert idx.get(b"s").tier == "device" and idx.get(b"s").pins == 1
    store.let_go([(b"s", entry)])
    ready(idx, b"t", 10)  # s leaves the device, stays known in the shared store
    assert idx.get(b"s") is None and idx.remote[b"s"] == Meta(10, 0, b"o")
    assert store.is_known(b"s") and idx.used["device"] == 10
    assert idx.clear() == 2 and not store.is_known(b"s")  # clear forgets it too


def test_remote_records_are_bounded_and_never_walked(monkeypatch) -> None:
    """A reservation's cost does not grow with the chunks the shared store
    is known to hold: they are records beside the entries, at most
    REMOTE_KNOWN of them."""
    from vllm_kvreuse.chunk_cache.engine import index as index_module

    monkeypatch.setattr(index_module, "REMOTE_KNOWN", 1000)
    idx = index(device=10)
    for number in range(100_000):
        idx.add(number.to_bytes(4, "big"), Meta(1, 0, b"o"), "remote")
    assert len(idx.remote) == 1000 and not idx.entries
    assert (99_999).to_bytes(4, "big") in idx.remote  # the latest kept
    ready(idx, b"a", 10)
    ready(idx, b"b", 10)  # makes room among the one local entry only
    assert list(idx.entries) == [b"b"]


def test_a_chunk_asked_for_soon_after_its_eviction_counts_as_thrashing() -> None:
    idx = index(device=10)
    store = ChunkStore(idx, hash, IDENTITY)
    ready(idx, b"a", 10)
    ready(idx, b"b", 10)  # evicts a
    store.note_miss(b"a")
    store.note_miss(b"never")
    assert store.stats.thrashed == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_blob_gives_back_its_tensor_bit_for_bit(dtype: torch.dtype) -> None:
    tensor = torch.randn(3, 2, 17, 2, 32).to(dtype)
    meta = Meta(17, 3, b"origin")
    blob = encode(tensor, b"k", "fp", meta)
    got, got_meta = decode(blob, b"k", "fp", expect=meta)
    assert got_meta == meta
    assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8))
    damaged = bytearray(blob)
    damaged[-3] ^= 1
    cases = [(bytes(damaged), b"k", "fp"), (blob, b"x", "fp"), (blob, b"k", "other")]
    for bad, key, store in [*cases, (blob[:40], b"k", "fp")]:
        with pytest.raises(CorruptChunk):
            decode(bad, key, store)
    with pytest.raises(CorruptChunk):  # another rank's bytes
        decode(blob, b"k", "fp", rank=1)


def test_disk_files_are_read_back_by_a_restart_of_the_same_layout(tmp_path) -> None:
    tensor = torch.randn(2, 2, 8, 1, 32)
    for rank in (0, 1):
        DiskFiles(tmp_path, "fp", rank, 2).write(b"a", tensor + rank, META)
    DiskFiles(tmp_path, "fp", 0, 2).write(b"half", tensor, META)  # rank 1 missing
    DiskFiles(tmp_path, "other", 0, 2).write(b"b", tensor, META)
    assert DiskFiles(tmp_path, "fp", 0, 2).scan() == [(b"a", META)]
    assert torch.equal(DiskFiles(tmp_path, "fp", 1, 2).read(b"a", META), tensor + 1)
    assert not list(tmp_path.rglob("*.tmp"))
    idx = index(device=0, disk=100)
    assert all(
        idx.add(key, meta, "disk")
        for key, meta in DiskFiles(tmp_path, "fp", 0, 2).scan()
    )
    assert idx.get(b"a").ready and idx.used["disk"] == 8


def worker(tmp_path: Path, shared: SharedStore | None = None, **kwargs) -> LocalTiers:
    return LocalTiers(
        torch.device("cpu"), DiskFiles(tmp_path, "fp", 0, 1), shared, **kwargs
    )


def test_a_worker_moves_chunks_down_and_up_bit_for_bit(tmp_path) -> None:
    from vllm_kvreuse.chunk_cache.engine.index import StoreOp

    tiers = worker(tmp_path)
    tensor = torch.randn(2, 2, 8, 1, 32).to(torch.bfloat16)
    tiers.put(b"a", tensor, META)
    tiers.apply(StoreOp("move", b"a", "device", "cpu", META))
    tiers.apply(StoreOp("move", b"a", "cpu", "disk", META))
    assert tiers.get(b"a") is None
    tiers.apply(StoreOp("move", b"a", "disk", "device", META))  # while writing
    assert torch.equal(tiers.get(b"a"), tensor)
    tiers.close()
    assert not list(tmp_path.rglob("*.kv"))  # back up: its file went
    tiers = worker(tmp_path)
    tiers.put(b"a", tensor, META)
    tiers.apply(StoreOp("move", b"a", "cpu", "disk", META))
    tiers.close()
    assert DiskFiles(tmp_path, "fp", 0, 1).scan() == [(b"a", META)]
    fresh = worker(tmp_path)  # a restart reads the file
    fresh.apply(StoreOp("move", b"a", "disk", "device", META))
    assert torch.equal(fresh.get(b"a"), tensor) and not fresh.take_lost()
    fresh.apply(StoreOp("evict", b"a", meta=META))
    fresh.close()
    assert not list(tmp_path.rglob("*.kv"))


def test_a_damaged_or_unwritable_disk_loses_the_chunk_not_the_worker(tmp_path) -> None:
    from vllm_kvreuse.chunk_cache.engine.index import StoreOp

    tiers = worker(tmp_path)
    tiers.put(b"a", torch.ones(1, 2, 8, 1, 32), META)
    tiers.apply(StoreOp("move", b"a", "cpu", "disk", META))
    tiers.close()
    path = DiskFiles(tmp_path, "fp", 0, 1).blob_path(b"a")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    tiers = worker(tmp_path)
    tiers.apply(StoreOp("move", b"a", "disk", "device", META))
    assert tiers.get(b"a") is None and tiers.take_lost() == {b"a"}
    # The tier's directory replaced by a file: every write fails (as on a full disk).
    directory = DiskFiles(tmp_path, "fp", 0, 1).directory
    for file in directory.iterdir():
        file.unlink()
    directory.rmdir()
    directory.write_text("not a directory")
    tiers.put(b"b", torch.ones(1, 2, 8, 1, 32), META)
    tiers.apply(StoreOp("move", b"b", "cpu", "disk", META))
    tiers.close()
    assert tiers.take_lost() == {b"b"}


@pytest.fixture
def valkey(tmp_path):
    from vllm_kvreuse.testing.valkey import ValkeyServer

    with ValkeyServer(log_path=tmp_path / "valkey.log", maxmemory_mib=64) as server:
        yield server


def test_the_shared_store_gives_back_what_a_server_wrote(valkey, tmp_path) -> None:
    tensor = torch.randn(2, 2, 8, 2, 32).to(torch.bfloat16)
    writer = SharedStore(valkey.url, "fp", rank=0)
    assert writer.put(b"a", tensor, META)
    reader = SharedStore(valkey.url, "fp", rank=0)
    assert reader.lookup([b"a", b"b"]) == {b"a": META}
    assert torch.equal(reader.get(b"a", META), tensor)
    assert SharedStore(valkey.url, "other", rank=0).lookup([b"a"]) == {}
    with pytest.raises(CorruptChunk):
        reader.get(b"b")


def test_a_shared_store_that_dies_loses_chunks_not_requests(valkey, tmp_path) -> None:
    from vllm_kvreuse.chunk_cache.engine.index import StoreOp

    store = SharedStore(valkey.url, "fp", rank=0, timeout=0.5)
    tiers = worker(tmp_path, store)
    tiers.put(b"a", torch.ones(1, 2, 8, 1, 32), META)
    tiers.publish(b"a", META)
    tiers.close()
    valkey.kill()
    assert store.lookup([b"a"]) == {} and not store.available
    tiers = worker(tmp_path, store)
    tiers.apply(StoreOp("move", b"a", "remote", "device", META))
    assert tiers.take_lost() == {b"a"}
    tiers.close()


def test_the_valkey_server_is_the_packaged_binary() -> None:
    from vllm_kvreuse.testing.valkey import valkey_binary

    assert os.access(valkey_binary(), os.X_OK)
