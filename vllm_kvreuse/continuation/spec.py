"""Continuation's declaration: its settings, request keys and class."""

from __future__ import annotations

from vllm_kvreuse.continuation.params import (
    CONTINUATION_OF,
    parse_retain_kv,
    parse_retain_kv_ttl,
)
from vllm_kvreuse.core.options import Option, parse_bool, parse_fraction, parse_seconds
from vllm_kvreuse.core.spec import ArgKey, FeatureSpec

SPEC = FeatureSpec(
    name="continuation",
    options=(
        Option(
            "enable_continuation",
            parse_bool,
            False,
            "Turns continuation requests on: a request with 'retain_kv' keeps its "
            "KV blocks after it finishes, and a request with 'continuation_of' "
            "inherits them (see --retain-kv-ttl, --retain-kv-max-fraction).",
        ),
        Option(
            "retain_kv_ttl",
            parse_seconds,
            60.0,
            "Seconds a finished request that asked for 'retain_kv' keeps its KV "
            "blocks for continuation requests, unless it set its own "
            "'retain_kv_ttl'.",
        ),
        Option(
            "retain_kv_max_fraction",
            parse_fraction,
            0.25,
            "Largest share of the KV block pool that retained requests may hold. "
            "Past it, or when the scheduler runs short of blocks, the oldest "
            "retained request is released first (its continuations then fall back "
            "to prefix caching).",
        ),
        Option(
            "continuation_wait_timeout",
            parse_seconds,
            60.0,
            "Seconds a continuation request waits for a parent that is still "
            "running before it is answered 404.",
        ),
    ),
    keys=(
        ArgKey(
            "retain_kv",
            "continuation",
            True,
            parse_retain_kv,
            "Keep this request's KV blocks after it finishes, for continuations.",
        ),
        ArgKey(
            "retain_kv_ttl",
            "continuation",
            True,
            parse_retain_kv_ttl,
            "Seconds to keep them (default --retain-kv-ttl).",
        ),
    ),
    switch="enable_continuation",
    feature="vllm_kvreuse.continuation.feature:Continuation",
    promptless_fields=(CONTINUATION_OF,),
    render_completion="vllm_kvreuse.continuation.serving:render_completion",
    render_chat="vllm_kvreuse.continuation.serving:render_chat",
    # Before the chunk cache's renderer: a body naming a parent is a
    # continuation whatever else it sends (its prompt is the parent's,
    # chunked as the parent was).
    render_order=-1,
    on_final_output="vllm_kvreuse.continuation.frontend:on_final_output",
)
