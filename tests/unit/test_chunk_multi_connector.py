"""The chunk cache's stats and /metrics through vLLM's MultiConnector.

Inside a MultiConnector, the API server gets each child's stats as a dict
keyed by the child's class name and rebuilds them by that name through
vLLM's connector factory, then hands each to the child's Prometheus
metrics. These drive vLLM's own MultiConnector classes with a
``MultiConnector`` config built as ``--enable-chunk-cache`` builds it.
"""

from __future__ import annotations

import functools

import prometheus_client
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
    MultiKVConnectorStats,
)

import vllm_kvreuse
from vllm_kvreuse.chunk_cache.engine.stats import ChunkCacheStats
from vllm_kvreuse.chunk_cache.engine_args import CHUNK_CONNECTOR, beside_chunk_connector

OTHER = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")


def test_multiconnector_rebuilds_chunk_stats_by_name() -> None:
    """What the API server's stats logger does with a step's stats."""
    vllm_kvreuse.register()
    stats = MultiConnector.build_kv_connector_stats(
        {CHUNK_CONNECTOR: {"hits": 2, "misses": 1, "chunks": 3}}
    )
    assert isinstance(stats, MultiKVConnectorStats)
    chunk = stats[CHUNK_CONNECTOR]
    assert isinstance(chunk, ChunkCacheStats)
    assert stats.reduce()[CHUNK_CONNECTOR]["hit_rate"] == round(2 / 3, 3)


def test_registering_twice_changes_nothing() -> None:
    vllm_kvreuse.register()
    vllm_kvreuse.register()
    assert MultiConnector.build_kv_connector_stats({CHUNK_CONNECTOR: {}}) is not None


def test_multiconnector_prom_metrics_carry_the_chunk_cache_series() -> None:
    registry = prometheus_client.CollectorRegistry()
    metric_types = {
        kind: functools.partial(kind, registry=registry)
        for kind in (
            prometheus_client.Gauge,
            prometheus_client.Counter,
            prometheus_client.Histogram,
        )
    }
    config = VllmConfig(kv_transfer_config=beside_chunk_connector(OTHER))
    prom = MultiConnector.build_prom_metrics(
        config, metric_types, ["engine"], {0: ["0"]}
    )
    prom.observe({CHUNK_CONNECTOR: {"hits": 2, "chunks": 3}}, engine_idx=0)
    hits = registry.get_sample_value(
        "vllm_kvreuse:chunk_cache_hits_total", {"engine": "0"}
    )
    chunks = registry.get_sample_value(
        "vllm_kvreuse:chunk_cache_chunks", {"engine": "0"}
    )
    assert (hits, chunks) == (2.0, 3.0)
