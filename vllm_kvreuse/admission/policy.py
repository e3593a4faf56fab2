"""The cache-hit threshold rule, free of vLLM internals (RFC #24256).

hit rate = tokens whose KV need not be computed ÷ tokens the request needs KV
for (its prompt; for a preempted request, the prompt plus the outputs it had
produced). A request is rejected when its hit rate is *below* its threshold,
so a threshold of 0.0 admits everything and a rate equal to the threshold is
admitted. The last prompt token is always computed (its logits are needed),
so a threshold of 1.0 rejects every request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_kvreuse.core.options import parse_fraction

FINISH_REASON = "cache_threshold"
"""finish_reason of a rejected request; also its stop_reason on the engine side."""

REQUEST_FIELD = "cache_hit_threshold"
"""Top-level HTTP body field, and the key in ``SamplingParams.extra_args``."""


def parse_threshold(value: Any) -> float:
    """Validates a per-request threshold; raises ``ValueError`` naming the field."""
    return parse_fraction(value, REQUEST_FIELD)


def effective_threshold(
    extra_args: Mapping[str, Any] | None, global_threshold: float
) -> float:
    """The request's own threshold if it set one, else the global one.

    ``extra_args`` was parsed in the frontend (the value is a float); an
    explicit ``None`` means "not set".
    """
    if extra_args is not None and extra_args.get(REQUEST_FIELD) is not None:
        return extra_args[REQUEST_FIELD]
    return global_threshold


@dataclass(frozen=True, slots=True)
class Decision:
    """Outcome of one admission check."""

    admit: bool
    hit_rate: float
    threshold: float


def decide(num_hit_tokens: int, num_tokens: int, threshold: float) -> Decision:
    """Admits iff ``num_hit_tokens / num_tokens >= threshold``."""
    assert 0 <= num_hit_tokens <= num_tokens, (
        f"hit tokens {num_hit_tokens} outside [0, {num_tokens}]: a hit source "
        "counted tokens the request does not have"
    )
    rate = num_hit_tokens / num_tokens if num_tokens else 1.0
    return Decision(admit=rate >= threshold, hit_rate=rate, threshold=threshold)
