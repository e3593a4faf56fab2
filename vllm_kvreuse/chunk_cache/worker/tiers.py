"""A worker's stored chunks across the tiers: memory, disk, the shared store.

The scheduler's index decides where each chunk is (:mod:`..engine.index`);
this class carries its decisions out (:meth:`LocalTiers.apply`), in order:

- memory holds the device and CPU tiers (a chunk's tensor on the KV cache's
  device, or in pinned host memory where the device copies from it), each
  with the :class:`Meta` it was stored under;
- a chunk moved to disk is written in the background and stays readable
  from memory until its file is complete, so a chunk being written is never
  read from disk; the same holds for the shared store;
- a chunk moved up to the device tier is read from where it was (memory,
  its file, the shared store) and checked to be the chunk the index names
  (its meta); a read that fails (missing, damaged, another writer's chunk,
  the store down) marks the chunk *lost*: its loads fail, the request
  computes it instead, and the scheduler forgets it (:meth:`take_lost`).
  A file read back up is removed (the index counts it on the device now).

Memory is bounded: background writes queue at most :data:`QUEUE_BYTES`
(a publish or spill beyond it is dropped and counted, :meth:`take_dropped`),
so a slow disk or store costs chunks, never memory.

Threads: one for disk writes and shared-store writes (blocking I/O that
must not hold up a step); on a GPU, one more for moves down to the CPU tier
(:class:`~vllm_kvreuse.device.host_copy.HostCopies`: pinned memory and the
copy, off the step). A chunk moving down stays readable on the device until
its host copy is complete, and any later decision about it (evicted, moved
up or further down, stored again) cancels the move first, so the copy never
replaces what the index decided since. Reads run on the worker's thread, in
the step that loads them.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from vllm.logger import init_logger

from vllm_kvreuse.chunk_cache.messages import StoreOp
from vllm_kvreuse.chunk_cache.tiers.codec import ChunkKey, CorruptChunk, Meta
from vllm_kvreuse.chunk_cache.tiers.disk import DiskFiles
from vllm_kvreuse.chunk_cache.tiers.shared import SharedStore
from vllm_kvreuse.device.host_copy import HostCopies, to_host

logger = init_logger(__name__)

QUEUE_BYTES = 1 << 30
"""Bytes of chunks queued for background writes, at most."""


class LocalTiers:
    """This worker rank's chunk bytes, wherever the index put them."""

    def __init__(
        self,
        device: torch.device,
        disk: DiskFiles | None = None,
        shared: SharedStore | None = None,
        queue_bytes: int = QUEUE_BYTES,
        host_copies: HostCopies | None = None,
    ) -> None:
        self.device = device
        self.disk, self.shared = disk, shared
        self.host_copies = host_copies
        self._moving: dict[ChunkKey, torch.Tensor] = {}  # down to the CPU tier
        self.memory: dict[ChunkKey, torch.Tensor] = {}  # [layers, 2, n, H, D]
        self.metas: dict[ChunkKey, Meta] = {}  # of the chunks in memory
        self._writing: dict[ChunkKey, torch.Tensor] = {}  # to disk, not yet there
        self._lost: set[ChunkKey] = set()
        self._dropped = 0
        self._queued = 0  # bytes
        self.queue_bytes = queue_bytes
        self._lock = threading.Lock()
        self._io = (
            ThreadPoolExecutor(1, thread_name_prefix="kvreuse-chunk-io")
            if disk is not None or shared is not None
            else None
        )

    def get(self, key: ChunkKey) -> torch.Tensor | None:
        """The chunk's tensor if it is in memory (None: lost, or not here)."""
        return self.memory.get(key)

    def meta(self, key: ChunkKey) -> Meta | None:
        """The meta of the chunk in memory under ``key``."""
        return self.metas.get(key)

    def put(self, key: ChunkKey, tensor: torch.Tensor, meta: Meta) -> None:
        self._cancel_move(key)
        self.memory[key], self.metas[key] = tensor, meta
        self._lost.discard(key)

    def take_lost(self) -> set[ChunkKey]:
        """Chunks whose bytes could not be read since the last call."""
        with self._lock:
            lost, self._lost = self._lost, set()
        return lost

    def take_dropped(self) -> int:
        """Background writes not queued since the last call."""
        with self._lock:
            dropped, self._dropped = self._dropped, 0
        return dropped

    def apply(self, op: StoreOp) -> None:
        """One of the index's decisions (publishes: :meth:`publish`)."""
        self._cancel_move(op.key)
        if op.kind == "evict":
            self._forget(op.key)
            if self.disk is not None and self._io is not None:
                self._io.submit(self._quietly, self.disk.delete, op.key, op.meta)
        elif op.kind == "move" and op.target == "device":
            self._move_up(op.key, op.source, op.meta)
        elif op.kind == "move" and op.target == "cpu":
            self._move_down(op.key)
        elif op.kind == "move" and op.target == "disk":
            self._spill(op.key, op.meta)

    def publish(self, key: ChunkKey, meta: Meta | None) -> None:
        """Writes a just-saved chunk to the shared store, in the background
        (dropped and counted when the queue is full)."""
        tensor = self.memory.get(key)
        if self.shared is None or tensor is None or meta is None:
            return
        self._submit(tensor, self.shared.put, key, tensor, meta)

    def close(self) -> None:
        if self.host_copies is not None:
            self.host_copies.close()
        if self._io is not None:
            self._io.shutdown(wait=True)

    def _move_down(self, key: ChunkKey) -> None:
        """The chunk to host memory: in the background where the device
        allows it (it stays readable on the device until then), else now."""
        tensor = self.memory.get(key)
        if tensor is None:
            return
        if self.host_copies is not None:

            def done(host: torch.Tensor) -> None:
                self._moved(key, tensor, host)

            with self._lock:
                self._moving[key] = tensor  # before the copy can finish
            if self.host_copies.start(tensor, done):
                return
            self._cancel_move(key)
        self.memory[key] = to_host(tensor)

    def _moved(self, key: ChunkKey, tensor: torch.Tensor, host: torch.Tensor) -> None:
        """A move down complete (on the copy thread): the host copy replaces
        the device tensor, unless a later decision cancelled the move."""
        with self._lock:
            if self._moving.get(key) is not tensor:
                return
            del self._moving[key]
            if self.memory.get(key) is tensor:
                self.memory[key] = host

    def _cancel_move(self, key: ChunkKey) -> None:
        """Called before anything else changes ``key``'s place in memory."""
        with self._lock:
            self._moving.pop(key, None)

    def _forget(self, key: ChunkKey) -> None:
        self.memory.pop(key, None)
        self.metas.pop(key, None)
        with self._lock:
            self._writing.pop(key, None)

    def _move_up(self, key: ChunkKey, source: Any, meta: Meta | None) -> None:
        tensor = self.memory.get(key)
        if tensor is None:
            with self._lock:
                tensor = self._writing.get(key)
        if tensor is not None and meta is not None and self.metas.get(key) != meta:
            tensor = None  # another chunk under this key: not the index's
        try:
            if tensor is None and source == "disk" and self.disk is not None:
                tensor = self.disk.read(key, meta)
            elif tensor is None and source == "remote" and self.shared is not None:
                tensor = self.shared.get(key, meta)
        except (OSError, CorruptChunk) as error:
            logger.warning(
                "chunk cache: cannot read a chunk from %s: %s", source, error
            )
        if tensor is None or (meta is None and key not in self.metas):
            self._forget(key)
            with self._lock:
                self._lost.add(key)
            return
        self.memory[key] = tensor.to(self.device)
        self.metas[key] = meta if meta is not None else self.metas[key]
        if source == "disk" and self.disk is not None and self._io is not None:
            # Counted on the device now: its file goes (after its write, if
            # it is being written: one I/O thread keeps them in order).
            self._io.submit(self._quietly, self.disk.delete, key, meta)

    def _spill(self, key: ChunkKey, meta: Meta | None) -> None:
        tensor = self.memory.pop(key, None)
        if tensor is None or self.disk is None or meta is None:
            self.metas.pop(key, None)
            return
        with self._lock:
            self._writing[key] = tensor
        if not self._submit(tensor, self._write, key, tensor, meta):
            self._forget(key)  # the index has it on disk: it will be lost
            with self._lock:
                self._lost.add(key)

    def _write(self, key: ChunkKey, tensor: torch.Tensor, meta: Meta) -> None:
        assert self.disk is not None
        try:
            self.disk.write(key, tensor, meta)
        except OSError as error:  # disk full, gone: the chunk is lost
            logger.warning("chunk cache: cannot write a chunk to disk: %s", error)
            with self._lock:
                if self._writing.get(key) is tensor:
                    self._lost.add(key)
        finally:
            with self._lock:
                if self._writing.get(key) is tensor:
                    del self._writing[key]

    def _submit(self, tensor: torch.Tensor, call: Any, *args: Any) -> bool:
        """Queues a background write of ``tensor``; False (counted) when the
        queue holds :attr:`queue_bytes` already."""
        size = tensor.numel() * tensor.element_size()
        with self._lock:
            if self._io is None or self._queued + size > self.queue_bytes:
                self._dropped += 1
                return False
            self._queued += size

        def run() -> None:
            try:
                self._quietly(call, *args)
            finally:
                with self._lock:
                    self._queued -= size

        self._io.submit(run)
        return True

    @staticmethod
    def _quietly(call: Any, *args: Any) -> None:
        """A background write or delete; a failure costs only the copy."""
        try:
            call(*args)
        except Exception as error:
            logger.warning("chunk cache: background store I/O failed: %s", error)
