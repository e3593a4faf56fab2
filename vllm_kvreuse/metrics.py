"""Prometheus metrics of vllm-kvreuse, served by vLLM's own ``/metrics``.

They live in the API-server (frontend) process, where ``/metrics`` is served,
in prometheus_client's default registry, which vLLM exports. Created on first
use so that importing this module registers nothing.
"""

from __future__ import annotations

import functools

from prometheus_client import Counter

PREFIX = "vllm_kvreuse:"


@functools.cache
def cache_threshold_rejections() -> Counter:
    return Counter(
        PREFIX + "cache_threshold_rejections",
        "Requests turned back with finish_reason 'cache_threshold', by whether "
        "the request was new ('admission') or back from a preemption "
        "('preempted').",
        labelnames=("stage",),
    )


def count_cache_threshold_rejection(preempted: bool) -> None:
    cache_threshold_rejections().labels(
        stage="preempted" if preempted else "admission"
    ).inc()
