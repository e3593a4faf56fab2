"""Every ``SamplingParams.extra_args`` key vllm-kvreuse reads, in one table.

Per-request options reach the engine only through ``extra_args``. Each key
has an owner (the feature that reads it, or ``core``), a visibility, and a
validator:

- *public* keys may be set by any client: a top-level HTTP body field of the
  same name, ``vllm_xargs``, or ``SamplingParams(extra_args=...)`` offline;
- *internal* keys are set by the plugin alone. The plugin seals the
  ``extra_args`` it writes (:func:`internal_args`) with a per-process token
  that no client can know, and :func:`validate` refuses an internal key
  without it. So a client that sends ``vllm_xargs: {"kvreuse_beam": ...}``
  gets a 400 naming the key, and no forged internal key reaches the engine.

:func:`validate` runs in the frontend process for every request, HTTP or
offline (the ``InputProcessor._validate_params`` patch), and refuses public
keys whose feature is off on this server, with the flag that turns it on.
The engine trusts what passed; it still contains a failure to the one
request (see :mod:`vllm_kvreuse.core.layer`).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from vllm_kvreuse.admission.policy import parse_threshold
from vllm_kvreuse.beam.policy import (
    CONFIG_KEY,
    LEAF_EOS_KEY,
    NODE_KEY,
    BeamConfig,
    parse_token_id,
)
from vllm_kvreuse.chunk_cache.params import parse_lengths
from vllm_kvreuse.chunk_cache.recompute import REQUEST_KEY as CHUNK_RECOMPUTE
from vllm_kvreuse.chunk_cache.recompute import parse_recompute
from vllm_kvreuse.continuation.params import parse_retain_kv, parse_retain_kv_ttl
from vllm_kvreuse.core.request_keys import CHUNKS, PARENT, PREFIX, SEAL

Owner = Literal["core", "admission", "continuation", "beam", "chunk_cache"]

_TOKEN = secrets.token_hex(16)  # per process; never leaves this process's API


class BadRequestArgs(ValueError):
    """A malformed or forbidden plugin key; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _parse_parent(value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > 512:
        raise ValueError(f"{PARENT} must be a request id string")
    return value


def _parse_seal(value: Any) -> str:
    return str(value)


@dataclass(frozen=True, slots=True)
class ArgKey:
    """One ``extra_args`` key: who reads it, who may set it, how it is checked."""

    name: str
    owner: Owner
    public: bool
    parse: Callable[[Any], Any]
    doc: str


KEYS: tuple[ArgKey, ...] = (
    ArgKey("cache_hit_threshold", "admission", True, parse_threshold,
           "Reject the request unless this share of its prompt is cached."),
    ArgKey("retain_kv", "continuation", True, parse_retain_kv,
           "Keep this request's KV blocks after it finishes, for continuations."),
    ArgKey("retain_kv_ttl", "continuation", True, parse_retain_kv_ttl,
           "Seconds to keep them (default --retain-kv-ttl)."),
    ArgKey(PARENT, "core", False, _parse_parent,
           "Engine id of the request whose held blocks this one inherits."),
    ArgKey(CONFIG_KEY, "beam", False, BeamConfig.parse,
           "A beam-search root request's configuration."),
    ArgKey(NODE_KEY, "beam", False, parse_token_id,
           "A catalog beam's SID trie node."),
    ArgKey(LEAF_EOS_KEY, "beam", False, parse_token_id,
           "The token a catalog beam at a whole item may take (EOS)."),
    ArgKey(CHUNK_RECOMPUTE, "chunk_cache", True, parse_recompute,
           "Which chunk tokens a chunked request recomputes (else the server's)."),
    ArgKey(CHUNKS, "chunk_cache", False, parse_lengths,
           "Token lengths of a chunked prompt's chunks."),
    ArgKey(SEAL, "core", False, _parse_seal,
           "The plugin's per-process seal on extra_args it wrote itself."),
)  # fmt: skip
KEYS_BY_NAME: dict[str, ArgKey] = {key.name: key for key in KEYS}
PUBLIC_FIELDS: tuple[str, ...] = tuple(key.name for key in KEYS if key.public)
"""Public keys, also accepted as top-level HTTP body fields."""

ENABLING_FLAG: dict[Owner, str] = {
    "admission": "--global-cache-hit-threshold (0 admits all but requests "
    "that set their own threshold)",
    "continuation": "--enable-continuation",
    "beam": "--engine-beam-search",
    "chunk_cache": "--enable-chunk-cache",
}


def internal_args(**values: Any) -> dict[str, Any]:
    """``extra_args`` entries only the plugin may write, validated and sealed."""
    for name, value in values.items():
        key = KEYS_BY_NAME[name]
        assert not key.public, f"{name} is public: set it directly"
        key.parse(value)
    return {**values, SEAL: _TOKEN}


def is_sealed(extra_args: Mapping[str, Any]) -> bool:
    return extra_args.get(SEAL) == _TOKEN


def check_client_keys(extra_args: Mapping[str, Any] | None) -> None:
    """Refuses internal or unknown plugin keys in what a client sent
    (``vllm_xargs``), before the plugin adds its own."""
    for name in extra_args or ():
        key = KEYS_BY_NAME.get(name)
        if (key is None and name.startswith(PREFIX)) or (key and not key.public):
            raise BadRequestArgs(_forbidden(name), name)


def validate(extra_args: Mapping[str, Any] | None, enabled: frozenset[Owner]) -> None:
    """Raises :class:`BadRequestArgs` for the first bad plugin key.

    ``enabled``: the features switched on in this server (``core`` always).
    A public key set to null, or ``retain_kv`` false, asks for nothing and is
    accepted whatever is enabled.
    """
    if not extra_args:
        return
    sealed = is_sealed(extra_args)
    for name, value in extra_args.items():
        key = KEYS_BY_NAME.get(name)
        if key is None:
            if name.startswith(PREFIX):
                raise BadRequestArgs(_forbidden(name), name)
            continue  # not ours: vLLM's or another plugin's
        if not key.public and not sealed:
            raise BadRequestArgs(_forbidden(name), name)
        if value is None or value is False:
            continue
        if key.owner not in enabled:
            raise BadRequestArgs(
                f"{name} needs a server started with {ENABLING_FLAG[key.owner]}",
                name,
            )
        try:
            key.parse(value)
        except (TypeError, ValueError) as e:
            raise BadRequestArgs(str(e), name) from None


def _forbidden(name: str) -> str:
    return (
        f"{name!r} is not a request field clients may set: keys starting with "
        f"{PREFIX!r} are reserved for vllm-kvreuse itself"
    )
