"""The cache-hit threshold's declaration: its setting, request key and class."""

from __future__ import annotations

from vllm_kvreuse.admission.policy import parse_threshold
from vllm_kvreuse.core.options import Option, parse_fraction
from vllm_kvreuse.core.spec import ArgKey, FeatureSpec

SPEC = FeatureSpec(
    name="admission",
    options=(
        Option(
            "global_cache_hit_threshold",
            parse_fraction,
            None,
            "Turns the cache-hit threshold on: reject a request whose KV-cache hit "
            "rate (cached prompt tokens, local prefix cache plus KV connector, "
            "divided by prompt tokens) is below this value with finish_reason "
            "'cache_threshold', before any KV block is allocated. A request's own "
            "'cache_hit_threshold' overrides it; 0 admits every request that sets "
            "none. Unset (the default): the threshold is off and requests that set "
            "'cache_hit_threshold' are refused (400).",
        ),
    ),
    keys=(
        ArgKey(
            "cache_hit_threshold",
            "admission",
            True,
            parse_threshold,
            "Reject the request unless this share of its prompt is cached.",
        ),
    ),
    switch="global_cache_hit_threshold",
    switch_note="0 admits all but requests that set their own threshold",
    feature="vllm_kvreuse.admission.feature:CacheHitThreshold",
    # Before continuation's: a rejection's record sees "cache_threshold".
    on_final_output="vllm_kvreuse.admission.frontend:on_final_output",
)
