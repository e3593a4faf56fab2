"""The cache-hit threshold's counter in ``/metrics``."""

from __future__ import annotations

from vllm_kvreuse.metrics import counter


def count_cache_threshold_rejection(preempted: bool) -> None:
    counter(
        "cache_threshold_rejections",
        "Requests turned back with finish_reason 'cache_threshold', by whether "
        "the request was new ('admission') or back from a preemption "
        "('preempted').",
        ("stage",),
    ).labels(stage="preempted" if preempted else "admission").inc()
