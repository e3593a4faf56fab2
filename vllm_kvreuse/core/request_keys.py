"""The plugin's internal ``extra_args`` keys, and their seal.

An internal key is written by the plugin alone: a feature builds the dict
it writes from the constants here (``seal({CHUNKS: lengths})``), never
from a spelled name, and :func:`seal` marks it with a per-process token no
client can know. Every internal key is defined here, once, whichever
feature owns it: features never import each other and core imports no
feature, so the one place a key several packages read can live is here,
and the one place the seal can be applied to all of them is here too.
Owners, visibility and validators of every key (public ones included) are
in the feature specs; :mod:`vllm_kvreuse.request_args` builds the table and
validates each request against it, the seal included. Core's own keys are
:data:`CORE_KEYS`.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

from vllm_kvreuse.core.spec import ArgKey

PREFIX = "kvreuse_"
"""Keys starting with it are reserved: unknown ones are refused too."""

SEAL = "kvreuse_sealed"
"""Core: the plugin's per-process seal on ``extra_args`` it wrote."""

PARENT = "kvreuse_parent"
"""Core (inheritance): the engine request id whose held KV blocks this
request may inherit (continuation children, beam members). Read by the
ledger."""

BEAM = "kvreuse_beam"
"""Beam search: a root request's configuration (a ``BeamConfig`` dict)."""

SID_NODE = "kvreuse_sid_node"
"""Beam search: the SID-catalog trie node a catalog beam's next token
continues from (0, the root, for the group's first step)."""

SID_EOS = "kvreuse_sid_eos"
"""Beam search: the token allowed after a whole catalog item (EOS), absent
when a beam at a leaf may not take one (no EOS, ``ignore_eos``)."""

CHUNKS = "kvreuse_chunks"
"""Chunk cache: a chunked prompt's chunk token lengths. A continuation
child carries its parent's (its spec marks the key ``inherited``)."""

DOCUMENTS = "kvreuse_documents"
"""Chunk cache: ``[first, end)``, the chunks of a chunked prompt that are
documents (candidates of answer paths); absent: every chunk after the
first. A chat conversation's turns are not."""

INTERNAL = frozenset({SEAL, PARENT, BEAM, SID_NODE, SID_EOS, CHUNKS, DOCUMENTS})
"""Every internal key; the key table checks that each spec's internal keys
are among them."""

_TOKEN = secrets.token_hex(16)  # per process; never leaves this process's API


def seal(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (internal keys only) as ``extra_args`` entries sealed by
    this process: the frontend's validation accepts them as the plugin's."""
    unknown = set(values) - INTERNAL
    assert not unknown, f"not internal keys (core/request_keys.py): {unknown}"
    return {**values, SEAL: _TOKEN}


def is_sealed(extra_args: Mapping[str, Any]) -> bool:
    """Whether this process sealed ``extra_args``."""
    return extra_args.get(SEAL) == _TOKEN


def carried(extra_args: Mapping[str, Any], keys: frozenset[str]) -> dict[str, Any]:
    """The entries of ``extra_args`` under ``keys`` (the specs' ``inherited``
    keys, :func:`vllm_kvreuse.core.spec.inherited_keys`) that a child of this
    request carries; None values left out."""
    return {key: extra_args[key] for key in keys if extra_args.get(key) is not None}


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
