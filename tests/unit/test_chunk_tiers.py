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
    from vllm_kvreuse.chunk_cache.messages import StoreOp

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
    from vllm_kvreuse.chunk_cache.messages import StoreOp

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
    from vllm_kvreuse.chunk_cache.messages import StoreOp

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


# -- faults: what a damaged, hostile, shared or slow store can do ---------------


def blob_with_header(header: dict, raw: bytes = b"") -> bytes:
    """A blob whose header says anything at all (as anyone who can write to
    the store can make one)."""
    import json
    import struct

    from vllm_kvreuse.chunk_cache.tiers.codec import MAGIC

    text = json.dumps(header).encode()
    return MAGIC + struct.pack("<I", len(text)) + text + raw


@pytest.mark.parametrize(
    "change",
    [
        {"dtype": "Tensor"},  # a torch attribute that is no dtype
        {"dtype": "nonsense"},
        {"shape": [1, 2, -8, 1, 32]},
        {"shape": "everything"},
        {"shape": [1, 2, 8, 1, 33]},  # another layout
        {"tokens": 0},
        {"start": "x"},
        {"origin": "not hex"},
        {"rank": 1},
        {"crc32": 0},
    ],
)
def test_a_hostile_header_is_a_miss_never_an_error(change: dict) -> None:
    import json

    from vllm_kvreuse.chunk_cache.tiers.codec import Layout

    tensor = torch.ones(1, 2, 8, 1, 32)
    good = encode(tensor, b"k", "fp", META)
    layout = Layout(torch.float32, (1, 2, 1, 32))
    assert decode(good, b"k", "fp", expect=META, layout=layout)[1] == META
    size = int.from_bytes(good[5:9], "little")
    header = json.loads(good[9 : 9 + size]) | change
    with pytest.raises(CorruptChunk):
        decode(blob_with_header(header, good[9 + size :]), b"k", "fp", layout=layout)
    for bad in (blob_with_header([]), good[:9] + b"{", good[:5] + b"\xff" * 4):
        with pytest.raises(CorruptChunk):
            decode(bad, b"k", "fp")


def test_a_store_key_seals_every_blob_against_writers_without_it() -> None:
    """With a key, a blob must carry a valid HMAC under it: a forged one (a
    fresh checksum over new bytes), one under another key and an unsealed
    one are all misses; a reader without a key refuses sealed blobs."""
    key = b"k" * 32
    tensor = torch.randn(1, 2, 8, 1, 32)
    sealed = encode(tensor, b"k", "fp", META, secret=key)
    assert torch.equal(decode(sealed, b"k", "fp", secret=key)[0], tensor)
    forged = encode(tensor + 1, b"k", "fp", META)  # anyone can checksum
    for blob, secret in [
        (forged, key),
        (encode(tensor, b"k", "fp", META, secret=b"o" * 32), key),
        (sealed, None),
    ]:
        with pytest.raises(CorruptChunk):
            decode(blob, b"k", "fp", secret=secret)


def test_two_writers_at_different_positions_never_mix(tmp_path) -> None:
    """Two servers share a directory and store one document computed at
    different positions: the last writer's blob wins, and a reader expecting
    the other's meta gets a miss, never bytes re-rotated by the wrong
    distance; a writer deletes only files of the chunk it stored."""
    first, second = Meta(8, 3, b"one"), Meta(8, 40, b"two")
    a = DiskFiles(tmp_path, "fp", 0, 1)
    b = DiskFiles(tmp_path, "fp", 0, 1)
    a.write(b"d", torch.ones(1, 2, 8, 1, 32), first)
    b.write(b"d", torch.zeros(1, 2, 8, 1, 32), second)
    with pytest.raises(CorruptChunk):
        a.read(b"d", first)
    assert torch.equal(b.read(b"d", second), torch.zeros(1, 2, 8, 1, 32))
    a.delete(b"d", first)  # a's eviction leaves b's bytes
    assert b.read(b"d", second) is not None


def test_data_parallel_ranks_keep_their_own_files(tmp_path) -> None:
    ranks = [DiskFiles(tmp_path, "fp", 0, 1, writer=w) for w in (0, 1)]
    for number, files in enumerate(ranks):
        files.write(b"d", torch.full((1, 2, 8, 1, 32), float(number)), META)
    ranks[0].delete(b"d", META)
    assert ranks[1].scan() == [(b"d", META)] and not ranks[0].scan()
    assert torch.equal(ranks[1].read(b"d", META), torch.ones(1, 2, 8, 1, 32))


def test_a_restart_removes_what_a_crash_left_behind(tmp_path) -> None:
    files = DiskFiles(tmp_path, "fp", 0, 1)
    stale = files.directory / "dead.0.kv.123.tmp"
    stale.write_bytes(b"half a blob")
    os.utime(stale, (0, 0))
    fresh = files.directory / "live.0.kv.456.tmp"  # another server writing now
    fresh.write_bytes(b"being written")
    files.scan()
    assert not stale.exists() and fresh.exists()


def test_a_full_write_queue_drops_and_counts_never_grows(tmp_path) -> None:
    """A slow disk or store: writes beyond the queue's bytes are dropped
    (a spill's chunk is lost, a publish is skipped), and counted."""
    from vllm_kvreuse.chunk_cache.messages import StoreOp

    tiers = worker(tmp_path, queue_bytes=0)
    tiers.put(b"a", torch.ones(1, 2, 8, 1, 32), META)
    tiers.apply(StoreOp("move", b"a", "cpu", "disk", META))
    assert tiers.take_lost() == {b"a"} and tiers.take_dropped() == 1
    assert tiers.get(b"a") is None and not tiers._writing
    tiers.close()


def test_a_stale_plan_never_loads_a_chunk_stored_again_elsewhere() -> None:
    """A chunk lost while two plans pin it is forgotten at once; stored
    again by a third request at another position, it is a new entry: the
    old plans' pins go nowhere, and their loads (naming the old position)
    would not match the new bytes."""
    idx = index(device=100)
    store = ChunkStore(idx, hash, IDENTITY)
    assert idx.reserve(b"d", 10, 5, b"old", "first")
    store.saved(b"d")
    held = [(b"d", store.hold(b"d")), (b"d", store.hold(b"d"))]
    assert idx.get(b"d").pins == 2
    store.lost([b"d"])
    assert not store.is_known(b"d") and idx.num_pinned == 0
    assert idx.reserve(b"d", 10, 70, b"new", "third")  # computed, stored again
    store.saved(b"d")
    mine = store.hold(b"d")
    store.let_go(held)  # the old plans end
    assert idx.get(b"d") is mine and mine.pins == 1 and mine.start == 70


def test_the_shared_store_writes_in_pieces_and_shows_whole_chunks(
    valkey, monkeypatch
) -> None:
    """A blob larger than a piece goes in pieces (no send outlasts the
    timeout); a chunk is visible to lookups only once every rank wrote."""
    from vllm_kvreuse.chunk_cache.tiers import shared

    monkeypatch.setattr(shared, "PIECE_BYTES", 4096)
    tensors = [torch.randn(2, 2, 8, 2, 32) + rank for rank in (0, 1)]
    writers = [SharedStore(valkey.url, "fp", rank, ranks=2) for rank in (0, 1)]
    assert writers[0].put(b"a", tensors[0], META)
    assert writers[0].lookup([b"a"]) == {}  # rank 1 has not written yet
    assert writers[1].put(b"a", tensors[1], META)
    assert writers[0].lookup([b"a"]) == {b"a": META}
    for rank in (0, 1):
        assert torch.equal(writers[rank].get(b"a", META), tensors[rank])
    with pytest.raises(CorruptChunk):
        writers[0].get(b"a", Meta(8, 99, b"elsewhere"))


def test_a_slow_store_costs_a_lookup_its_deadline(valkey) -> None:
    """A store that stalls (CLIENT PAUSE holds every client's command)
    answers the engine's lookup with nothing within the lookup deadline,
    not the I/O timeout, and is left alone for a while after."""
    import time

    import valkey as client

    from vllm_kvreuse.chunk_cache.tiers.shared import LOOKUP_TIMEOUT

    store = SharedStore(valkey.url, "fp", rank=0, timeout=LOOKUP_TIMEOUT)
    assert store.lookup([b"a"]) == {} and store.available  # connected
    client.from_url(valkey.url).execute_command("CLIENT", "PAUSE", 2000, "ALL")
    began = time.monotonic()
    assert store.lookup([b"a"]) == {} and not store.available
    waited = time.monotonic() - began
    assert waited < 1.5, f"the lookup waited {waited:.2f} s for a stalled store"


class GatedCopies:
    """Copies to the host that finish only when the test opens the gate
    (what a GPU's background copy looks like to the tiers)."""

    def __init__(self, budget: int = 1 << 30, fail: bool = False) -> None:
        import threading

        from vllm_kvreuse.device.host_copy import HostCopies

        self.gate, self.fail = threading.Event(), fail
        self.copies = HostCopies(self._copy, budget)

    def _copy(self, tensor: torch.Tensor):
        def finish() -> torch.Tensor:
            assert self.gate.wait(10)
            if self.fail:
                raise RuntimeError("copy engine gone")
            return tensor.clone()

        return finish

    def finish(self) -> None:
        self.gate.set()
        self.copies.close()


def moving(change) -> tuple[LocalTiers, torch.Tensor, GatedCopies]:
    """A chunk moved down to the CPU tier, then ``change(tiers)`` while
    its copy is in flight, then the copy completes."""
    from vllm_kvreuse.chunk_cache.messages import StoreOp

    gated = GatedCopies()
    tiers = LocalTiers(torch.device("cpu"), host_copies=gated.copies)
    tensor = torch.randn(2, 2, 8, 1, 32)
    tiers.put(b"a", tensor, META)
    tiers.apply(StoreOp("move", b"a", "device", "cpu", META))
    assert tiers.get(b"a") is tensor  # readable on the device meanwhile
    change(tiers)
    gated.finish()
    return tiers, tensor, gated


def test_a_move_to_host_memory_completes_off_the_step_bit_for_bit() -> None:
    tiers, tensor, _ = moving(lambda tiers: None)
    moved = tiers.get(b"a")
    assert moved is not tensor and torch.equal(moved, tensor)
    assert tiers.meta(b"a") == META and not tiers._moving


def test_a_later_decision_cancels_a_move_in_flight() -> None:
    """The copy never undoes what the index decided after asking for it:
    an eviction stays evicted, a chunk moved back up stays on the device,
    a chunk stored again keeps its new tensor."""
    from vllm_kvreuse.chunk_cache.messages import StoreOp

    tiers, _, _ = moving(lambda t: t.apply(StoreOp("evict", b"a", meta=META)))
    assert tiers.get(b"a") is None and tiers.meta(b"a") is None
    tiers, tensor, _ = moving(
        lambda t: t.apply(StoreOp("move", b"a", "cpu", "device", META))
    )
    assert tiers.get(b"a") is tensor
    again = torch.ones(2, 2, 8, 1, 32)
    tiers, _, _ = moving(lambda t: t.put(b"a", again, META))
    assert tiers.get(b"a") is again


def test_a_failed_or_unaffordable_copy_leaves_the_chunk_readable() -> None:
    from vllm_kvreuse.chunk_cache.messages import StoreOp

    gated = GatedCopies(fail=True)
    tiers = LocalTiers(torch.device("cpu"), host_copies=gated.copies)
    tensor = torch.randn(2, 2, 8, 1, 32)
    tiers.put(b"a", tensor, META)
    tiers.apply(StoreOp("move", b"a", "device", "cpu", META))
    gated.finish()
    assert tiers.get(b"a") is tensor  # where it was: still the chunk
    small = GatedCopies(budget=tensor.numel() * tensor.element_size() - 1)
    assert not small.copies.start(tensor, lambda host: None)  # over the budget
    small.finish()
