"""Per-request continuation options, as they ride in ``SamplingParams.extra_args``.

``retain_kv`` / ``retain_kv_ttl``: set on a parent by the caller (HTTP body
fields, ``vllm_xargs`` or offline ``extra_args``): keep my KV blocks after I
finish. A child names its parent with the core's internal key
``kvreuse_parent`` (:mod:`vllm_kvreuse.request_args`), which the frontend
sets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_kvreuse.core.options import parse_seconds

CONTINUATION_OF = "continuation_of"
"""HTTP body field: the response id a child continues (its prompt comes
from that parent, so a completion body may leave ``prompt`` out)."""
RETAIN_KV = "retain_kv"
RETAIN_KV_TTL = "retain_kv_ttl"


def parse_retain_kv(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{RETAIN_KV} must be true or false, got {value!r}")
    return value


def parse_retain_kv_ttl(value: Any) -> float:
    return parse_seconds(value, RETAIN_KV_TTL)


def wants_retention(extra_args: Mapping[str, Any] | None) -> bool:
    return bool(extra_args and extra_args.get(RETAIN_KV) is True)


def own_ttl(extra_args: Mapping[str, Any] | None) -> float | None:
    """The request's ``retain_kv_ttl`` in seconds, None if it gives none
    (validation accepts any number of seconds, ``"30"`` included, and
    carries it parsed: a float)."""
    return extra_args.get(RETAIN_KV_TTL) if extra_args else None


def retention_ttl(extra_args: Mapping[str, Any] | None, default: float) -> float:
    ttl = own_ttl(extra_args)
    return default if ttl is None else ttl
