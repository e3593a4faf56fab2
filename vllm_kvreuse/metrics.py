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


@functools.cache
def continuation_requests() -> Counter:
    return Counter(
        PREFIX + "continuation_requests",
        "Continuation requests by outcome: 'resolved' (parent found, child "
        "sent), 'not_found' (answered 404), 'completed' (child finished).",
        labelnames=("outcome",),
    )


@functools.cache
def continuation_cached_tokens() -> Counter:
    return Counter(
        PREFIX + "continuation_cached_prompt_tokens",
        "Prompt tokens of finished continuation requests that were not "
        "computed: inherited from the parent or hit in the prefix cache.",
    )


def count_continuation(outcome: str, num_cached_tokens: int) -> None:
    continuation_requests().labels(outcome=outcome).inc()
    if num_cached_tokens:
        continuation_cached_tokens().inc(num_cached_tokens)


@functools.cache
def beam_groups() -> Counter:
    return Counter(PREFIX + "beam_groups", "Beam searches run inside the engine.")


@functools.cache
def beam_forks() -> Counter:
    return Counter(
        PREFIX + "beam_forks",
        "Beams moved onto a parent beam's KV blocks: new member requests, and "
        "live members re-seated onto another beam (engine beam search).",
    )


@functools.cache
def beam_copied_blocks() -> Counter:
    return Counter(
        PREFIX + "beam_copied_blocks",
        "Partial tail blocks copied (copy-on-write) when forking beams.",
    )


@functools.cache
def beam_computed_tokens() -> Counter:
    return Counter(
        PREFIX + "beam_computed_prompt_tokens",
        "Prompt tokens computed by beam requests inside the engine (beyond the "
        "root request, which vLLM's prompt-token metrics count); their outputs "
        "never reach the frontend, so vLLM's metrics do not see them.",
    )


def count_beam_group(
    num_forks: int, num_copied_blocks: int, num_member_computed_tokens: int
) -> None:
    beam_groups().inc()
    beam_forks().inc(num_forks)
    beam_copied_blocks().inc(num_copied_blocks)
    beam_computed_tokens().inc(num_member_computed_tokens)
