"""Per-request continuation options, as they ride in ``SamplingParams.extra_args``.

- ``retain_kv`` / ``retain_kv_ttl``: set on a parent by the caller (HTTP body
  fields or offline ``extra_args``): keep my KV blocks after I finish.
- ``kvreuse_parent``: set on a child by the frontend: the parent's engine
  request id. The scheduler trusts it no further than prefix caching would:
  it inherits only the common token prefix, and only when cache salt and
  LoRA match.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_kvreuse.config import parse_seconds

RETAIN_KV = "retain_kv"
RETAIN_KV_TTL = "retain_kv_ttl"
PARENT = "kvreuse_parent"


def parse_retain_kv(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{RETAIN_KV} must be true or false, got {value!r}")
    return value


def parse_retain_kv_ttl(value: Any) -> float:
    return parse_seconds(value, RETAIN_KV_TTL)


def validate(extra_args: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` for a malformed continuation option."""
    if extra_args.get(RETAIN_KV) is not None:
        parse_retain_kv(extra_args[RETAIN_KV])
    if extra_args.get(RETAIN_KV_TTL) is not None:
        parse_retain_kv_ttl(extra_args[RETAIN_KV_TTL])
    parent = extra_args.get(PARENT)
    if parent is not None and not isinstance(parent, str):
        raise ValueError(f"{PARENT} must be a request id string, got {parent!r}")


def wants_retention(extra_args: Mapping[str, Any] | None) -> bool:
    return bool(extra_args and extra_args.get(RETAIN_KV))


def retention_ttl(extra_args: Mapping[str, Any] | None, default: float) -> float:
    if extra_args and extra_args.get(RETAIN_KV_TTL) is not None:
        return float(extra_args[RETAIN_KV_TTL])
    return default


def parent_of(extra_args: Mapping[str, Any] | None) -> str | None:
    return extra_args.get(PARENT) if extra_args else None
