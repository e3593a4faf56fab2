"""Prometheus metrics of vllm-kvreuse, served by vLLM's own ``/metrics``.

They live in the API-server (frontend) process, where ``/metrics`` is served,
in prometheus_client's default registry, which vLLM exports. Each feature
declares its own counters in its folder's ``metrics.py`` with
:func:`counter`; names no feature. Counters are created on first use, so
that importing a module registers nothing.
"""

from __future__ import annotations

import functools

from prometheus_client import Counter

PREFIX = "vllm_kvreuse:"


@functools.cache
def counter(name: str, documentation: str, labelnames: tuple[str, ...] = ()) -> Counter:
    """The counter ``vllm_kvreuse:<name>``, registered on the first call;
    later calls with the same arguments return the same counter."""
    return Counter(PREFIX + name, documentation, labelnames=labelnames)
