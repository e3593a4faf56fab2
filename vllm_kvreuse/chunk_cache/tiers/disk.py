"""The disk tier: stored chunks as files that outlive the server.

Layout under ``<root>/<store fingerprint>/``: ``<key hex>.<rank>.kv`` holds
one worker rank's blob (:mod:`.codec`) and ``<key hex>.json`` the chunk's
meta, written by the first rank after its blob. A file appears under its
name only once complete (written under a temporary name, then renamed), so
a reader sees a whole blob or none; a damaged one fails its checksum. A
restart finds every chunk whose meta and blobs are all there
(:meth:`DiskFiles.scan`); another model, dtype, layout or parallel size is
another fingerprint, so another directory, never read.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from vllm_kvreuse.chunk_cache.tiers.codec import (
    ChunkKey,
    CorruptChunk,
    Meta,
    decode,
    encode,
)


class DiskFiles:
    """One worker rank's view of the disk tier (the scheduler's: rank 0)."""

    def __init__(self, root: str | Path, store: str, rank: int, ranks: int) -> None:
        self.directory = Path(root) / store
        self.store, self.rank, self.ranks = store, rank, ranks
        self.directory.mkdir(parents=True, exist_ok=True)

    def blob_path(self, key: ChunkKey, rank: int | None = None) -> Path:
        return self.directory / f"{key.hex()}.{self.rank if rank is None else rank}.kv"

    def meta_path(self, key: ChunkKey) -> Path:
        return self.directory / f"{key.hex()}.json"

    def write(self, key: ChunkKey, tensor: torch.Tensor, meta: Meta) -> None:
        """Writes this rank's blob (and, on the first rank, the meta after
        it); raises OSError (disk full, ...) leaving no partial file."""
        _write_whole(self.blob_path(key), encode(tensor, key, self.store))
        if self.rank == 0:
            _write_whole(self.meta_path(key), meta.to_json().encode())

    def read(self, key: ChunkKey) -> torch.Tensor:
        """This rank's tensor of ``key`` (CPU); raises OSError or
        :class:`CorruptChunk`."""
        return decode(self.blob_path(key).read_bytes(), key, self.store)

    def delete(self, key: ChunkKey) -> None:
        for path in (
            self.blob_path(key),
            self.meta_path(key) if self.rank == 0 else None,
        ):
            if path is not None:
                path.unlink(missing_ok=True)

    def scan(self) -> list[tuple[ChunkKey, Meta]]:
        """The chunks whose meta and every rank's blob are here, most
        recently written first; unreadable metas are skipped."""
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


def _write_whole(path: Path, data: bytes) -> None:
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
