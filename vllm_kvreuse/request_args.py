"""Every ``SamplingParams.extra_args`` key vllm-kvreuse reads, in one table.

Per-request options reach the engine only through ``extra_args``. Each
feature declares its keys in its spec (:mod:`vllm_kvreuse.features` lists
them), core's are :data:`~vllm_kvreuse.core.request_keys.CORE_KEYS`; this
module names no feature. Each key has an owner (the feature that reads it,
or ``core``), a visibility, and a validator:

- *public* keys may be set by any client: a top-level HTTP body field of the
  same name, ``vllm_xargs``, or ``SamplingParams(extra_args=...)`` offline;
- *internal* keys are set by the plugin alone. Each is defined in
  :mod:`vllm_kvreuse.core.request_keys`, whose :func:`~vllm_kvreuse.core.
  request_keys.seal` marks the ``extra_args`` the plugin writes with a
  per-process token that no client can know, and :func:`validate` refuses
  an internal key without it. So a client that sends ``vllm_xargs:
  {"kvreuse_beam": ...}`` gets a 400 naming the key, and no forged internal
  key reaches the engine.

:func:`validate` runs in the frontend process for every request, HTTP or
offline (the ``InputProcessor._validate_params`` patch, which carries the
parsed values in the request's ``extra_args``), parses every key it knows
(the one parse a request's plugin keys get: the engine reads what they
carry as it is, never parsing them again), and refuses public keys whose
feature is off on this server, with the flag that turns it on.
The engine trusts what passed; it still contains a failure to the one
request (see :mod:`vllm_kvreuse.core.layer`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_kvreuse.core.request_keys import (
    CORE_KEYS,
    INTERNAL,
    PARENT,
    PREFIX,
    is_sealed,
)
from vllm_kvreuse.core.spec import ArgKey, FeatureSpec
from vllm_kvreuse.features import SPECS

__all__ = [
    "ENABLING_FLAG",
    "KEYS",
    "KEYS_BY_NAME",
    "PARENT",
    "PUBLIC_FIELDS",
    "TABLE",
    "ArgKey",
    "BadRequestArgs",
    "KeyTable",
    "check_client_keys",
    "validate",
]

Owner = str
"""A feature's spec name, or ``core``."""


class BadRequestArgs(ValueError):
    """A malformed or forbidden plugin key; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class KeyTable:
    """The request keys of ``specs`` and core's, and the checks over them.

    The module's own table is :data:`TABLE`, over
    :data:`~vllm_kvreuse.features.SPECS`; its methods are this module's
    functions.
    """

    def __init__(self, specs: tuple[FeatureSpec, ...]) -> None:
        self.keys: tuple[ArgKey, ...] = (
            *(key for spec in specs for key in spec.keys),
            *CORE_KEYS,
        )
        """Every key: each feature's (from its spec), then core's."""
        self.by_name: dict[str, ArgKey] = {key.name: key for key in self.keys}
        assert len(self.by_name) == len(self.keys), "two request keys share a name"
        stray = {key.name for key in self.keys if not key.public} - INTERNAL
        assert not stray, f"define internal keys in core/request_keys.py: {stray}"
        self.public_fields = tuple(key.name for key in self.keys if key.public)
        """Public keys, also accepted as top-level HTTP body fields."""
        self.enabling_flag: dict[Owner, str] = {
            spec.name: spec.enabling_flag for spec in specs
        }
        """For each feature, the flag a request using it is told to turn on."""

    def check_client_keys(self, extra_args: Mapping[str, Any] | None) -> None:
        """Refuses internal or unknown plugin keys in what a client sent
        (``vllm_xargs``), before the plugin adds its own."""
        for name in extra_args or ():
            key = self.by_name.get(name)
            if (key is None and name.startswith(PREFIX)) or (key and not key.public):
                raise BadRequestArgs(_forbidden(name), name)

    def validate(
        self, extra_args: Mapping[str, Any] | None, enabled: frozenset[Owner]
    ) -> dict[str, Any]:
        """Raises :class:`BadRequestArgs` for the first bad plugin key;
        returns each plugin key's value parsed (``ArgKey.parse``: as the
        engine reads it), for the caller to carry in the request.

        ``enabled``: the features switched on in this server (``core``
        always). A public key set to null, or ``retain_kv`` false, asks for
        nothing and is accepted whatever is enabled.
        """
        if not extra_args:
            return {}
        sealed = is_sealed(extra_args)
        parsed: dict[str, Any] = {}
        for name, value in extra_args.items():
            key = self.by_name.get(name)
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
                    f"{name} needs a server started with "
                    f"{self.enabling_flag[key.owner]}",
                    name,
                )
            try:
                parsed[name] = key.parse(value)
            except (TypeError, ValueError) as e:
                raise BadRequestArgs(str(e), name) from None
        return parsed


TABLE = KeyTable(SPECS)
"""The keys of every feature in :data:`~vllm_kvreuse.features.SPECS`."""
KEYS: tuple[ArgKey, ...] = TABLE.keys
KEYS_BY_NAME: dict[str, ArgKey] = TABLE.by_name
PUBLIC_FIELDS: tuple[str, ...] = TABLE.public_fields
ENABLING_FLAG: dict[Owner, str] = TABLE.enabling_flag
check_client_keys = TABLE.check_client_keys
validate = TABLE.validate


def _forbidden(name: str) -> str:
    return (
        f"{name!r} is not a request field clients may set: keys starting with "
        f"{PREFIX!r} are reserved for vllm-kvreuse itself"
    )
