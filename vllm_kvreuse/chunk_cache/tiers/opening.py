"""How a process opens the store's tiers below memory: the one place both
sides set them up from the settings.

The engine core opens them as rank 0 to find chunks (its disk tier read
back at start, its shared-store lookups with a short deadline); each worker
opens them as its own rank, with its KV layout and the store key, to write
and read the bytes. Both name the same directory and namespace: the store's
fingerprint (:mod:`.identity`).
"""

from __future__ import annotations

from typing import Any

from vllm_kvreuse.chunk_cache.tiers.codec import Layout
from vllm_kvreuse.chunk_cache.tiers.disk import DiskFiles
from vllm_kvreuse.chunk_cache.tiers.identity import store_fingerprint, store_secret
from vllm_kvreuse.chunk_cache.tiers.shared import (
    IO_TIMEOUT,
    LOOKUP_TIMEOUT,
    SharedStore,
)


def open_tiers(
    vllm_config: Any,
    settings: Any,
    rank: int,
    ranks: int,
    layout: Layout | None = None,
) -> tuple[DiskFiles | None, SharedStore | None]:
    """The disk tier's files and the shared store ``settings`` ask for (None
    where unset), as rank ``rank`` of ``ranks`` sees them. ``layout``: a
    worker's KV layout (it reads and writes bytes, sealed with the store key
    when one is set); None: the engine core (it reads chunks' metas only)."""
    fingerprint = store_fingerprint(vllm_config)
    secret = store_secret(settings) if layout is not None else None
    disk = shared = None
    if path := settings.chunk_cache_disk_path:
        writer = vllm_config.parallel_config.data_parallel_rank
        disk = DiskFiles(path, fingerprint, rank, ranks, writer, secret, layout)
    if url := settings.chunk_cache_remote_url:
        timeout = LOOKUP_TIMEOUT if layout is None else IO_TIMEOUT
        shared = SharedStore(
            url, fingerprint, rank, ranks, timeout=timeout, secret=secret, layout=layout
        )
    return disk, shared
