"""The shared store: chunks several servers write and read, in Valkey or Redis.

One hash per chunk, ``kvreuse:<store fingerprint>:<key hex>``. Each worker
rank writes its blob (:mod:`.codec`, which names the chunk's meta, rank and
fingerprint) in pieces of at most :data:`PIECE_BYTES` (fields
``<rank>:<i>``, then ``<rank>:n``), so no single send outlasts the
timeout whatever the chunk's size. The ``meta`` field that makes the
chunk visible to lookups is set only once every rank has written (the
``written`` counter reaches the rank count): a reader never finds a chunk
some rank lacks. Writers of the same chunk at different positions may mix
ranks in one hash; each blob names its meta, so a rank whose blob is not
the chunk the meta says is a miss (that request computes it), never a
load. Every hash expires :data:`TTL` seconds after its last write; the
store must also be given a memory limit and an LRU eviction policy
(``maxmemory``, ``allkeys-lru``): docs/chunk_cache.md.

Lookups run on the engine core's thread at a request's arrival, so the
scheduler's store answers within :data:`LOOKUP_TIMEOUT`; the workers'
reads and writes (their I/O threads, and the step that moves a chunk up)
within :data:`IO_TIMEOUT` a piece. A server that cannot reach the store
(down, slow, full) treats it as empty for :data:`RETRY_AFTER` seconds and
logs once; requests then compute what they would have loaded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from vllm.logger import init_logger

from vllm_kvreuse.chunk_cache.tiers.codec import (
    ChunkKey,
    CorruptChunk,
    Layout,
    Meta,
    decode,
    encode,
)
from vllm_kvreuse.chunk_cache.tiers.urls import redact_url

logger = init_logger(__name__)

RETRY_AFTER = 30.0
"""Seconds a server leaves the store alone after failing to reach it."""
LOOKUP_TIMEOUT = 0.1
"""Seconds the engine core waits for a lookup (it stalls arrivals)."""
IO_TIMEOUT = 2.0
"""Seconds a worker waits for one piece of a read or write."""
PIECE_BYTES = 16 << 20
"""The largest field written or read at once."""
TTL = 7 * 24 * 3600
"""Seconds a chunk stays in the store after its last write."""


class SharedStore:
    """One process's connection to the shared store."""

    def __init__(
        self,
        url: str,
        store: str,
        rank: int,
        ranks: int = 1,
        timeout: float = IO_TIMEOUT,
        secret: bytes | None = None,
        layout: Layout | None = None,
    ) -> None:
        self.url, self.store, self.rank, self.ranks = url, store, rank, ranks
        self.timeout, self.secret, self.layout = timeout, secret, layout
        self._client: Any = None
        self._down_until = 0.0
        self._lock = threading.Lock()

    def name(self, key: ChunkKey) -> str:
        return f"kvreuse:{self.store}:{key.hex()}"

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def put(self, key: ChunkKey, tensor: torch.Tensor, meta: Meta) -> bool:
        """Writes this rank's blob (then, once every rank has, the meta);
        False where the store is unreachable."""
        blob = encode(tensor, key, self.store, meta, self.rank, self.secret)
        return self._call(lambda c: self._put(c, key, blob, meta), False)

    def get(self, key: ChunkKey, expect: Meta | None = None) -> torch.Tensor:
        """This rank's tensor of ``key`` (CPU), checked to be ``expect``'s;
        raises :class:`CorruptChunk` if the store lacks it, is unreachable
        or holds other or damaged bytes."""
        blob = self._call(lambda c: self._get(c, key), None)
        if blob is None:
            raise CorruptChunk("not in the shared store, or the store is unreachable")
        tensor, _ = decode(
            blob, key, self.store, self.rank, expect, self.layout, self.secret
        )
        return tensor

    def lookup(self, keys: Sequence[ChunkKey]) -> dict[ChunkKey, Meta]:
        """The metas of those of ``keys`` the store holds (one round trip)."""
        if not keys:
            return {}

        def query(client: Any) -> list:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.hget(self.name(key), "meta")
            return pipe.execute()

        found = {}
        for key, raw in zip(keys, self._call(query, [None] * len(keys)), strict=True):
            if raw is not None:
                try:
                    found[key] = Meta.from_json(raw)
                except CorruptChunk:
                    continue
        return found

    def _put(self, client: Any, key: ChunkKey, blob: bytes, meta: Meta) -> bool:
        name = self.name(key)
        pieces = range(0, len(blob), PIECE_BYTES)
        for number, offset in enumerate(pieces):
            client.hset(
                name, f"{self.rank}:{number}", blob[offset : offset + PIECE_BYTES]
            )
        client.hset(name, f"{self.rank}:n", len(pieces))
        if client.hincrby(name, "written", 1) >= self.ranks:
            client.hset(name, "meta", meta.to_json())
        client.expire(name, TTL)
        return True

    def _get(self, client: Any, key: ChunkKey) -> bytes | None:
        name = self.name(key)
        count = client.hget(name, f"{self.rank}:n")
        if count is None:
            return None
        pieces = [
            client.hget(name, f"{self.rank}:{number}") for number in range(int(count))
        ]
        if any(piece is None for piece in pieces):
            return None
        return b"".join(pieces)

    def _call(self, call: Any, default: Any) -> Any:
        """``call(client)``, or ``default`` while the store is unreachable."""
        import valkey

        if not self.available:
            return default
        try:
            with self._lock:
                if self._client is None:
                    self._client = valkey.from_url(
                        self.url, socket_timeout=self.timeout,
                        socket_connect_timeout=self.timeout,
                    )  # fmt: skip
                client = self._client
            return call(client)
        except (valkey.exceptions.ValkeyError, OSError, ValueError) as error:
            self._down_until = time.monotonic() + RETRY_AFTER
            logger.warning(
                "chunk cache: the shared store at %s failed (%s); not used for "
                "%.0f s, chunks are computed meanwhile", redact_url(self.url), error,
                RETRY_AFTER,
            )  # fmt: skip
            return default
