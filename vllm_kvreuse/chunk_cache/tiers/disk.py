"""The disk tier: stored chunks as files that outlive the server.

Layout under ``<root>/<store fingerprint>/dp<data-parallel rank>/``:
``<key hex>.<rank>.kv`` holds one worker rank's blob (:mod:`.codec`, which
carries the chunk's meta) and ``<key hex>.json`` the chunk's meta, written
by the first rank after its blob, as the restart's index. Each
data-parallel rank writes a directory of its own, so ranks never delete
each other's files. A file appears under its name only once complete
(written under a temporary name, then renamed), so a reader sees a whole
blob or none; a damaged one fails its check, and a blob whose meta differs
from the one asked for (another writer's) is a miss. A writer deletes a
file only when its header names the chunk the writer stored. A restart
finds every chunk whose meta and blobs are all there (:meth:`DiskFiles.scan`)
and removes temporary files a crash left; another model, weights, dtype,
layout or parallel size is another fingerprint, so another directory,
never read.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from vllm_kvreuse.chunk_cache.tiers.codec import (
    MAX_HEADER,
    ChunkKey,
    CorruptChunk,
    Layout,
    Meta,
    decode,
    encode,
    read_meta,
)

STALE_TEMPORARY = 600.0
"""Seconds after which a temporary file is a crash's leftover, not a write
in progress."""


class DiskFiles:
    """One worker rank's view of the disk tier (the scheduler's: rank 0)."""

    def __init__(
        self,
        root: str | Path,
        store: str,
        rank: int,
        ranks: int,
        writer: int = 0,
        secret: bytes | None = None,
        layout: Layout | None = None,
    ) -> None:
        self.directory = Path(root) / store / f"dp{writer}"
        self.store, self.rank, self.ranks = store, rank, ranks
        self.secret, self.layout = secret, layout
        self.directory.mkdir(parents=True, exist_ok=True)

    def blob_path(self, key: ChunkKey, rank: int | None = None) -> Path:
        return self.directory / f"{key.hex()}.{self.rank if rank is None else rank}.kv"

    def meta_path(self, key: ChunkKey) -> Path:
        return self.directory / f"{key.hex()}.json"

    def write(self, key: ChunkKey, tensor: torch.Tensor, meta: Meta) -> None:
        """Writes this rank's blob (and, on the first rank, the meta after
        it); raises OSError (disk full, ...) leaving no partial file."""
        blob = encode(tensor, key, self.store, meta, self.rank, self.secret)
        _write_whole(self.blob_path(key), blob)
        if self.rank == 0:
            _write_whole(self.meta_path(key), meta.to_json().encode())

    def read(self, key: ChunkKey, expect: Meta | None = None) -> torch.Tensor:
        """This rank's tensor of ``key`` (CPU), checked to be ``expect``'s;
        raises OSError or :class:`CorruptChunk`."""
        blob = self.blob_path(key).read_bytes()
        tensor, _ = decode(
            blob, key, self.store, self.rank, expect, self.layout, self.secret
        )
        return tensor

    def delete(self, key: ChunkKey, meta: Meta | None = None) -> None:
        """Removes this rank's files of ``key`` if they hold the chunk
        ``meta`` names (any, where None): another writer's are left."""
        blob = self.blob_path(key)
        if meta is None or _holds(blob, meta):
            blob.unlink(missing_ok=True)
            if self.rank == 0:
                self.meta_path(key).unlink(missing_ok=True)

    def delete_all_ranks(self, key: ChunkKey) -> None:
        """Every rank's files of ``key`` (a chunk the restart cannot take)."""
        for rank in range(self.ranks):
            self.blob_path(key, rank).unlink(missing_ok=True)
        self.meta_path(key).unlink(missing_ok=True)

    def scan(self) -> list[tuple[ChunkKey, Meta]]:
        """The chunks whose meta and every rank's blob are here, most
        recently written first; unreadable metas are skipped, and
        temporary files a crash left behind are removed."""
        now = time.time()
        for path in self.directory.glob("*.tmp"):
            try:
                if now - path.stat().st_mtime > STALE_TEMPORARY:
                    path.unlink(missing_ok=True)
            except OSError:
                continue
        found = []
        for path in self.directory.glob("*.json"):
            try:
                key = bytes.fromhex(path.stem)
                meta = Meta.from_json(path.read_bytes())
                mtime = path.stat().st_mtime
            except (ValueError, OSError, CorruptChunk):
                continue
            if all(self.blob_path(key, rank).exists() for rank in range(self.ranks)):
                found.append((mtime, key, meta))
        found.sort(key=lambda item: item[0], reverse=True)
        return [(key, meta) for _, key, meta in found]


def _holds(path: Path, meta: Meta) -> bool:
    """Whether the blob at ``path`` is of the chunk ``meta`` names."""
    try:
        with open(path, "rb") as file:
            return read_meta(file.read(MAX_HEADER + 16)) == meta
    except CorruptChunk:  # damaged: nobody's chunk
        return True
    except OSError:
        return False


def _write_whole(path: Path, data: bytes) -> None:
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
