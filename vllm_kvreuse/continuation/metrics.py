"""Continuation's counters in ``/metrics``."""

from __future__ import annotations

from vllm_kvreuse.metrics import counter


def count_continuation(outcome: str, num_cached_tokens: int) -> None:
    counter(
        "continuation_requests",
        "Continuation requests by outcome: 'resolved' (parent found, child "
        "sent), 'not_found' (answered 404), 'completed' (child finished).",
        ("outcome",),
    ).labels(outcome=outcome).inc()
    if num_cached_tokens:
        counter(
            "continuation_cached_prompt_tokens",
            "Prompt tokens of finished continuation requests that were not "
            "computed: inherited from the parent or hit in the prefix cache.",
        ).inc(num_cached_tokens)
