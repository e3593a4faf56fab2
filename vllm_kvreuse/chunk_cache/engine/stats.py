"""Chunk-store statistics on vLLM's KV-connector stats path.

The scheduler-side connector reports, each step something changed, the
counters' increments since its last report and the current gauges
(:class:`ChunkCacheStats`); vLLM carries them to the API server with its
scheduler stats and hands them to :class:`ChunkCachePromMetrics`, which
updates ``/metrics``, and to its log line. No extra channel is opened.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from prometheus_client import Counter, Gauge
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from vllm_kvreuse.metrics import PREFIX


def _count(doc: str) -> Any:
    """A :class:`StoreStats` field: a total from 0, ``doc`` its help."""
    return field(default=0, metadata={"doc": doc})


@dataclass(slots=True)
class StoreStats:
    """Chunk-cache counters (totals): each is ``vllm_kvreuse:chunk_cache_<name>``
    in ``/metrics`` with its doc as help (:data:`COUNTERS`)."""

    hits: int = _count("Chunks of arriving requests found in the chunk store.")
    misses: int = _count(
        "Chunks of arriving requests not in the chunk store: computed in place."
    )
    hit_tokens: int = _count("Prompt tokens of chunks found in the chunk store.")
    miss_tokens: int = _count("Prompt tokens of chunks computed in place.")
    exact_hits: int = _count(
        "Chunks found stored as computed after the same tokens: loaded as "
        "full attention computes them."
    )
    device_hits: int = _count("Chunks found on the device tier.")
    cpu_hits: int = _count("Chunks found in the CPU tier (moved up to the device).")
    disk_hits: int = _count(
        "Chunks found in the disk tier (read, moved to the device)."
    )
    remote_hits: int = _count(
        "Chunks found in the shared store (read, moved to the device)."
    )
    prefill_steps: int = _count(
        "Engine steps chunked requests took from admission to their first "
        "token (divide by prefilled: a plain prefix hit takes one)."
    )
    prefilled: int = _count("Chunked requests that reached their first token.")
    saved: int = _count("Chunks computed in place and stored.")
    published: int = _count("Chunks written to the shared store.")
    demoted: int = _count("Chunks moved from the device tier to the CPU tier.")
    spilled: int = _count("Chunks moved from the CPU tier to the disk tier.")
    evictions: int = _count("Chunks evicted from the local tiers (LRU or clear).")
    refused: int = _count(
        "Chunks the store could not take (too large, or all pinned): "
        "computed in place and not stored."
    )
    load_failures: int = _count(
        "Loads whose chunk bytes a tier could not give (missing, damaged, the "
        "shared store down): the request computed them instead."
    )
    decided: int = _count(
        "Chunked requests answered on the documents their paths chose "
        "(chunk_attention 'paths' or 'choose')."
    )
    documents_kept: int = _count(
        "Documents those requests were answered on (divide by decided: the mean kept)."
    )
    io_dropped: int = _count(
        "Background writes to disk or the shared store not queued, the "
        "workers' write queue being full (a slow disk or store): a chunk "
        "not published, or one moved down and so evicted."
    )
    paths_capped: int = _count(
        "Chunked requests in chunk_attention 'paths' or 'choose' with more "
        "documents than --chunk-paths-max-documents: answered jointly, "
        "nothing scored."
    )
    thrashed: int = _count(
        "Chunks asked for again soon after the store evicted them: the store "
        "is too small for the workload."
    )


COUNTERS: dict[str, str] = {
    counter.name: counter.metadata["doc"] for counter in fields(StoreStats)
}
"""The store's counters (:class:`~.index.StoreStats`) and their help."""
GAUGES: dict[str, str] = {
    "chunks": "Chunks in the chunk store.",
    "stored_tokens": "Tokens of the chunks in the chunk store.",
    "pinned": "Chunks pinned (in use, or pinned by an admin).",
    "device_bytes": "Chunk-store bytes on the KV cache's device.",
    "cpu_bytes": "Chunk-store bytes in host memory (CPU tier).",
    "disk_bytes": "Chunk-store bytes in the disk tier.",
}


class Reports:
    """What the store reports each step: counter increments since its last
    report and the current gauges (O(1) comparison: it runs every step)."""

    def __init__(self) -> None:
        self._reported: dict[str, int] = {}

    def since_last(self, stats: StoreStats, gauges: dict[str, int]) -> dict | None:
        """None when nothing changed since the last report."""
        now = {**{name: getattr(stats, name) for name in COUNTERS}, **gauges}
        if now == self._reported:
            return None
        data = {
            name: value - self._reported.get(name, 0) if name in COUNTERS else value
            for name, value in now.items()
        }
        self._reported = now
        return data


@dataclass
class ChunkCacheStats(KVConnectorStats):
    """``data``: counter increments since the last report, current gauges."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> ChunkCacheStats:
        for name, value in other.data.items():
            self.data[name] = (
                self.data.get(name, 0) + value if name in COUNTERS else value
            )
        return self

    def reduce(self) -> dict[str, int | float]:
        looked_up = self.data.get("hits", 0) + self.data.get("misses", 0)
        hit_rate = self.data.get("hits", 0) / looked_up if looked_up else 0.0
        return {**self.data, "hit_rate": round(hit_rate, 3)}

    def is_empty(self) -> bool:
        return not self.data


class ChunkCachePromMetrics(KVConnectorPromMetrics):
    """``vllm_kvreuse:chunk_cache_*`` counters and gauges, per engine.

    Built by ``build_prom_metrics`` with the metric classes and labels vLLM
    hands every connector's metrics (its multiprocess-safe ones where it
    runs several API servers)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter, gauge = metric_types[Counter], metric_types[Gauge]
        self.counters = {
            name: self._per_engine(counter(**_series(name, doc, labelnames)))
            for name, doc in COUNTERS.items()
        }
        self.gauges = {
            name: self._per_engine(
                gauge(**_series(name, doc, labelnames), multiprocess_mode="mostrecent")
            )
            for name, doc in GAUGES.items()
        }

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        """One series of ``metric`` per engine."""
        return create_metric_per_engine(metric, self.per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in self.counters and value:
                self.counters[name][engine_idx].inc(value)
            elif name in self.gauges:
                self.gauges[name][engine_idx].set(value)


def _series(name: str, doc: str, labelnames: list[str]) -> dict[str, Any]:
    """``vllm_kvreuse:chunk_cache_<name>``'s name, help and labels."""
    return {
        "name": f"{PREFIX}chunk_cache_{name}",
        "documentation": doc,
        "labelnames": labelnames,
    }
