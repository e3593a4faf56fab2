"""The ``extra_args`` keys read outside the package that writes them.

Features never import each other and core imports no feature, so a key that
crosses that line is defined here, once, and imported by every reader. A key
only its own feature reads stays in that feature (``kvreuse_beam`` is
:data:`vllm_kvreuse.beam.policy.CONFIG_KEY`). Owners, visibility and
validators of every key: :mod:`vllm_kvreuse.request_args`; the keys core
owns are :data:`CORE_KEYS`, each feature's are in its spec.
"""

from __future__ import annotations

from typing import Any

from vllm_kvreuse.core.spec import ArgKey

PREFIX = "kvreuse_"
"""Keys starting with it are reserved: unknown ones are refused too."""

PARENT = "kvreuse_parent"
"""Internal: the engine request id whose held KV blocks this request may
inherit (continuation children, beam members). Read by the core layer."""

SEAL = "kvreuse_sealed"
"""Internal: the plugin's per-process seal on ``extra_args`` it wrote."""

CHUNKS = "kvreuse_chunks"
"""Internal: a chunked prompt's chunk token lengths. Written and read by the
chunk cache; continuation reads it too, so that a chunked parent's children
are chunked the same way."""


def _parse_parent(value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > 512:
        raise ValueError(f"{PARENT} must be a request id string")
    return value


def _parse_seal(value: Any) -> str:
    return str(value)


CORE_KEYS: tuple[ArgKey, ...] = (
    ArgKey(PARENT, "core", False, _parse_parent,
           "Engine id of the request whose held blocks this one inherits."),
    ArgKey(SEAL, "core", False, _parse_seal,
           "The plugin's per-process seal on extra_args it wrote itself."),
)  # fmt: skip
"""The keys core itself reads or writes (internal)."""
