"""The chunk store's tiers as the engine core sets them up at start.

Sizes come from the settings (:mod:`..spec`): the device tier a share of the
KV cache, the CPU tier a share of the machine's memory unless given, the
disk tier where a directory is given, the shared store where a URL is. A
disk tier left by an earlier run of the same model and layout is read back
(its chunks' metas: the bytes stay on disk until used). One log line says
what each tier holds for this model.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from vllm_kvreuse.chunk_cache.engine.index import ChunkIndex
from vllm_kvreuse.chunk_cache.engine.keys import key_hasher
from vllm_kvreuse.chunk_cache.engine.store import ChunkStore
from vllm_kvreuse.chunk_cache.tiers.identity import model_identity
from vllm_kvreuse.chunk_cache.tiers.opening import open_tiers
from vllm_kvreuse.chunk_cache.tiers.urls import redact_url

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger(__name__)

GIB = 2**30
CPU_SHARE, CPU_FLOOR, CPU_CAP = 0.1, 1 * GIB, 64 * GIB
"""The CPU tier's default: a tenth of the machine's memory, within these."""


def cpu_tier_bytes(setting: float | str) -> int:
    """The CPU tier's capacity for ``--chunk-cache-cpu-gib``, the whole
    server's (every rank's share together)."""
    if setting != "auto":
        return int(float(setting) * GIB)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(max(memory * CPU_SHARE, CPU_FLOOR), CPU_CAP))


def local_ranks(vllm_config: Any) -> tuple[int, int]:
    """(Worker ranks of this engine, engines of this server on this node):
    each worker holds its own share of every stored chunk, and each
    data-parallel engine its own store, so a server-wide size is divided
    by both."""
    parallel = vllm_config.parallel_config
    ranks = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    engines = getattr(parallel, "data_parallel_size_local", 1) or 1
    return ranks, engines


def build_store(
    vllm_config: Any, kv_cache_config: KVCacheConfig, block_size: int, settings: Any
) -> ChunkStore:
    """The engine core's chunk store over the tiers ``settings`` ask for."""
    kv_bytes = sum(tensor.size for tensor in kv_cache_config.kv_cache_tensors)
    bytes_per_token = max(kv_bytes // (kv_cache_config.num_blocks * block_size), 1)
    disk_path = settings.chunk_cache_disk_path
    ranks, engines = local_ranks(vllm_config)
    share = ranks * engines  # the index counts one rank's bytes of one engine
    disk = int(settings.chunk_cache_disk_gib * GIB) if disk_path else 0
    index = ChunkIndex(
        capacity={
            "device": int(kv_bytes * settings.chunk_cache_device_fraction),
            "cpu": cpu_tier_bytes(settings.chunk_cache_cpu_gib) // share,
            "disk": disk // share,
        },
        bytes_per_token=bytes_per_token,
    )
    files, shared = open_tiers(vllm_config, settings, 0, ranks)
    reloaded = 0
    for key, meta in files.scan() if files is not None else ():
        if index.add(key, meta, "disk"):
            reloaded += 1
        else:  # beyond the tier's size now: its files would only grow it
            files.delete_all_ranks(key)
    url = settings.chunk_cache_remote_url
    logger.info("chunk cache: %s", describe(index, disk_path, reloaded, url, share))
    return ChunkStore(
        index,
        key_hasher(vllm_config, settings.chunk_cache_hash),
        model_identity(vllm_config),
        shared,
    )


def describe(
    index: ChunkIndex, disk_path: str, reloaded: int, url: str, share: int = 1
) -> str:
    """What each tier holds, in GiB (the whole server's: every rank and
    engine on this node) and in tokens of this model."""

    def tier(name: str) -> str:
        size = index.capacity[name]
        whole = size * (share if name != "device" else 1)
        return f"{whole / GIB:.2f} GiB ({size // index.bytes_per_token:,} tokens)"

    parts = [f"device tier {tier('device')}", f"CPU tier {tier('cpu')}"]
    if share > 1:
        parts.append(f"host tiers split over {share} ranks and engines")
    if disk_path:
        parts.append(
            f"disk tier {tier('disk')} in {disk_path}, {reloaded} chunks read back"
        )
    if url:
        parts.append(f"shared store {redact_url(url)}")
    return ", ".join(parts)
