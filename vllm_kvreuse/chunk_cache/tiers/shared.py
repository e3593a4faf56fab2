"""The shared store: chunks several servers write and read, in Valkey or Redis.

One hash per chunk, ``kvreuse:<store fingerprint>:<key hex>``: a field per
worker rank holding its blob (:mod:`.codec`) and ``meta``, written by the
first rank after its blob. The content key carries the request's
``cache_salt`` and the meta the chunk's origin, so tenants never share KV
they should not and a chunk is loaded exactly where its origin allows. The
store sizes itself (``maxmemory`` with an LRU policy evicts whole hashes).

A server that cannot reach the store (down, slow, full) treats it as empty
for :data:`RETRY_AFTER` seconds and logs once; requests then compute what
they would have loaded. The client library (``valkey``, which also speaks
to Redis) is imported only when a URL is set.
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
    Meta,
    decode,
    encode,
)
from vllm_kvreuse.chunk_cache.tiers.urls import redact_url

logger = init_logger(__name__)

RETRY_AFTER = 30.0
"""Seconds a server leaves the store alone after failing to reach it."""


class SharedStore:
    """One process's connection to the shared store."""

    def __init__(self, url: str, store: str, rank: int, timeout: float = 2.0) -> None:
        self.url, self.store, self.rank, self.timeout = url, store, rank, timeout
        self._client: Any = None
        self._down_until = 0.0
        self._lock = threading.Lock()

    def name(self, key: ChunkKey) -> str:
        return f"kvreuse:{self.store}:{key.hex()}"

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def put(self, key: ChunkKey, tensor: torch.Tensor, meta: Meta) -> bool:
        """Writes this rank's blob (then, on the first rank, the meta);
        False where the store is unreachable."""
        blob = encode(tensor, key, self.store)
        return self._call(lambda c: self._put(c, key, blob, meta), False)

    def get(self, key: ChunkKey) -> torch.Tensor:
        """This rank's tensor of ``key`` (CPU); raises :class:`CorruptChunk`
        if the store lacks it, is unreachable or holds damaged bytes."""
        blob = self._call(lambda c: c.hget(self.name(key), str(self.rank)), None)
        if blob is None:
            raise CorruptChunk("not in the shared store, or the store is unreachable")
        return decode(blob, key, self.store)

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
        client.hset(self.name(key), str(self.rank), blob)
        if self.rank == 0:
            client.hset(self.name(key), "meta", meta.to_json())
        return True

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
        except (valkey.exceptions.ValkeyError, OSError) as error:
            self._down_until = time.monotonic() + RETRY_AFTER
            logger.warning(
                "chunk cache: the shared store at %s failed (%s); not used for "
                "%.0f s, chunks are computed meanwhile", redact_url(self.url), error,
                RETRY_AFTER,
            )  # fmt: skip
            return default
