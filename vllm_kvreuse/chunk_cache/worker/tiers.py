"""A worker's stored chunks across the tiers: memory, disk, the shared store.

The scheduler's index decides where each chunk is (:mod:`..engine.index`);
this class carries its decisions out (:meth:`LocalTiers.apply`), in order:

- memory holds the device and CPU tiers (a chunk's tensor on the KV cache's
  device, or in host memory);
- a chunk moved to disk is written in the background and stays readable
  from memory until its file is complete, so a chunk being written is never
  read from disk; the same holds for the shared store;
- a chunk moved up to the device tier is read from where it was (memory,
  its file, the shared store); a read that fails (missing, damaged, the
  store down) marks the chunk *lost*: its loads fail, the request computes
  it instead, and the scheduler forgets it (:meth:`take_lost`).

Threads: one, for disk writes and shared-store writes (blocking I/O that
must not hold up a step); reads run on the worker's thread, in the step
that loads them.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from vllm.logger import init_logger

from vllm_kvreuse.chunk_cache.engine.index import StoreOp
from vllm_kvreuse.chunk_cache.tiers.codec import ChunkKey, CorruptChunk, Meta
from vllm_kvreuse.chunk_cache.tiers.disk import DiskFiles
from vllm_kvreuse.chunk_cache.tiers.shared import SharedStore

logger = init_logger(__name__)


class LocalTiers:
    """This worker rank's chunk bytes, wherever the index put them."""

    def __init__(
        self,
        device: torch.device,
        disk: DiskFiles | None = None,
        shared: SharedStore | None = None,
    ) -> None:
        self.device = device
        self.disk, self.shared = disk, shared
        self.memory: dict[ChunkKey, torch.Tensor] = {}  # [layers, 2, n, H, D]
        self._writing: dict[ChunkKey, torch.Tensor] = {}  # to disk, not yet there
        self._lost: set[ChunkKey] = set()
        self._lock = threading.Lock()
        self._io = (
            ThreadPoolExecutor(1, thread_name_prefix="kvreuse-chunk-io")
            if disk is not None or shared is not None
            else None
        )

    def get(self, key: ChunkKey) -> torch.Tensor | None:
        """The chunk's tensor if it is in memory (None: lost, or not here)."""
        return self.memory.get(key)

    def put(self, key: ChunkKey, tensor: torch.Tensor) -> None:
        self.memory[key] = tensor
        self._lost.discard(key)

    def take_lost(self) -> set[ChunkKey]:
        """Chunks whose bytes could not be read since the last call."""
        with self._lock:
            lost, self._lost = self._lost, set()
        return lost

    def apply(self, op: StoreOp) -> None:
        """One of the index's decisions (publishes: :meth:`publish`)."""
        if op.kind == "evict":
            self.memory.pop(op.key, None)
            with self._lock:
                self._writing.pop(op.key, None)
            if self.disk is not None and self._io is not None:
                self._io.submit(self._quietly, self.disk.delete, op.key)
        elif op.kind == "move" and op.target == "device":
            self._move_up(op.key, op.source)
        elif op.kind == "move" and op.target == "cpu":
            if (tensor := self.memory.get(op.key)) is not None:
                self.memory[op.key] = tensor.to("cpu")
        elif op.kind == "move" and op.target == "disk":
            self._spill(op.key, op.meta)

    def publish(self, key: ChunkKey, meta: Meta | None) -> None:
        """Writes a just-saved chunk to the shared store, in the background."""
        tensor = self.memory.get(key)
        if self.shared is None or self._io is None or tensor is None or meta is None:
            return
        self._io.submit(self._quietly, self.shared.put, key, tensor, meta)

    def close(self) -> None:
        if self._io is not None:
            self._io.shutdown(wait=True)

    def _move_up(self, key: ChunkKey, source: Any) -> None:
        tensor = self.memory.get(key)
        if tensor is None:
            with self._lock:
                tensor = self._writing.get(key)
        try:
            if tensor is None and source == "disk" and self.disk is not None:
                tensor = self.disk.read(key)
            elif tensor is None and source == "remote" and self.shared is not None:
                tensor = self.shared.get(key)
        except (OSError, CorruptChunk) as error:
            logger.warning(
                "chunk cache: cannot read a chunk from %s: %s", source, error
            )
        if tensor is None:
            self.memory.pop(key, None)
            with self._lock:
                self._lost.add(key)
            return
        self.memory[key] = tensor.to(self.device)

    def _spill(self, key: ChunkKey, meta: Meta | None) -> None:
        tensor = self.memory.pop(key, None)
        if tensor is None or self.disk is None or self._io is None or meta is None:
            return
        with self._lock:
            self._writing[key] = tensor
        self._io.submit(self._write, key, tensor, meta)

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

    @staticmethod
    def _quietly(call: Any, *args: Any) -> None:
        """A background write or delete; a failure costs only the copy."""
        try:
            call(*args)
        except Exception as error:
            logger.warning("chunk cache: background store I/O failed: %s", error)
