"""Wrappers that put the plugin's settings on vLLM's CLI and EngineArgs.

Flow: ``vllm serve --global-cache-hit-threshold 0.5`` (or
``LLM(..., global_cache_hit_threshold=0.5)``) → ``EngineArgs.additional_config
["kvreuse"]`` → ``VllmConfig.additional_config`` → every process. Registered
in :mod:`vllm_kvreuse.patches`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from vllm_kvreuse.config import OPTIONS, OPTIONS_BY_NAME, KVReuseConfig, merge_settings


def attach_catalog_processor(engine_args: Any) -> None:
    """``--sid-catalog``: the catalog's logits processor (imported lazily:
    loading the plugin must not import torch-heavy modules)."""
    from vllm_kvreuse.beam.catalog_setup import attach_catalog_processor as attach

    attach(engine_args)


def finalize_vllm_config(vllm_config: Any) -> None:
    """What can only be settled on the finished ``VllmConfig`` (called at the
    end of its ``__post_init__``): the catalog processor of the runner vLLM
    will build."""
    if not KVReuseConfig.from_vllm_config(vllm_config).sid_catalog:
        return
    from vllm_kvreuse.beam.catalog_setup import select_catalog_processor

    select_catalog_processor(vllm_config)


GROUP_TITLE = "vllm-kvreuse"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the plugin's flags to ``parser`` once (a second call is a no-op)."""
    if any(group.title == GROUP_TITLE for group in parser._action_groups):
        return
    group = parser.add_argument_group(
        GROUP_TITLE, "KV-cache reuse features added by the vllm-kvreuse plugin."
    )
    for option in OPTIONS:
        how: dict[str, Any] = (
            {"action": argparse.BooleanOptionalAction}
            if isinstance(option.default, bool)
            else {"type": option.cli_type}
        )
        group.add_argument(
            option.flag,
            dest=option.name,
            default=option.default,
            help=option.help,
            **how,
        )


CHUNK_CONNECTOR = "KVReuseChunkConnector"
CHUNK_CONNECTOR_MODULE = "vllm_kvreuse.chunk_cache.connector"
MULTI_CONNECTOR = "MultiConnector"
CHUNK_CHILD: dict[str, Any] = {
    "kv_connector": CHUNK_CONNECTOR,
    "kv_connector_module_path": CHUNK_CONNECTOR_MODULE,
    "kv_role": "kv_both",
}
"""The chunk cache's entry in a ``MultiConnector``'s ``connectors`` list."""


def register_chunk_connector_name() -> None:
    """Makes ``KVReuseChunkConnector`` a name vLLM's connector factory knows.

    Why: inside a ``MultiConnector``, the API server rebuilds each child's
    stats from its class name (``MultiConnector.build_kv_connector_stats``
    calls ``KVConnectorFactory.get_connector_class_by_name``); a connector
    known only by module path would stop the stats logger there. Loading is
    lazy (module and class name only) and a second call changes nothing.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import (
        KVConnectorFactory,
    )

    try:
        KVConnectorFactory.get_connector_class_by_name(CHUNK_CONNECTOR)
    except ValueError:  # not registered yet
        KVConnectorFactory.register_connector(
            CHUNK_CONNECTOR, CHUNK_CONNECTOR_MODULE, CHUNK_CONNECTOR
        )


def has_chunk_connector(kv_transfer_config: Any) -> bool:
    """Whether ``kv_transfer_config`` names the chunk cache's connector,
    alone or as a ``MultiConnector`` child."""
    if kv_transfer_config is None:
        return False
    if kv_transfer_config.kv_connector == CHUNK_CONNECTOR:
        return True
    return kv_transfer_config.kv_connector == MULTI_CONNECTOR and any(
        child.get("kv_connector") == CHUNK_CONNECTOR
        for child in kv_transfer_config.kv_connector_extra_config.get("connectors", [])
    )


def attach_chunk_connector(engine_args: Any) -> None:
    """Puts the chunk-cache connector in ``kv_transfer_config`` when enabled.

    Without a user connector it takes the slot alone. Beside one
    (``--kv-transfer-config``), both go into vLLM's ``MultiConnector``, the
    chunk cache first: MultiConnector loads from the first child reporting
    hits, and the chunk cache reports hits only for its chunked requests
    (0 for every other), so a chunked request always loads its planned
    chunks and an ordinary one is answered by the user's connector. Every
    child sees every save. Idempotent: a config that already has the chunk
    connector is left as it is.
    """
    from vllm.config import KVTransferConfig

    if not KVReuseConfig.from_vllm_config(engine_args).enable_chunk_cache:
        return
    current = engine_args.kv_transfer_config
    if has_chunk_connector(current):
        return
    if current is None:
        engine_args.kv_transfer_config = KVTransferConfig(**CHUNK_CHILD)
        return
    engine_args.kv_transfer_config = beside_chunk_connector(current)


def beside_chunk_connector(user: Any) -> Any:
    """A ``MultiConnector`` config: the chunk cache, then ``user``'s
    connector (or a user's MultiConnector's children)."""
    import dataclasses

    from vllm.config import KVTransferConfig

    extra: dict[str, Any] = {}
    if user.kv_connector == MULTI_CONNECTOR:
        extra = dict(user.kv_connector_extra_config)
        children = list(extra.get("connectors", []))
    else:
        # MultiConnector hands each child the parent's engine_id.
        children = [
            {
                field.name: getattr(user, field.name)
                for field in dataclasses.fields(user)
                if field.name != "engine_id"
            }
        ]
    settings = {
        field.name: getattr(user, field.name) for field in dataclasses.fields(user)
    }
    settings.update(
        kv_connector=MULTI_CONNECTOR,
        kv_connector_module_path=None,
        kv_connector_extra_config={
            **extra,
            "connectors": [dict(CHUNK_CHILD), *children],
        },
    )
    return KVTransferConfig(**settings)


def wrap_add_cli_args(original: Callable[..., Any]) -> Callable[..., Any]:
    def add_cli_args(parser: Any) -> Any:
        parser = original(parser)
        add_arguments(parser)
        return parser

    return add_cli_args


def wrap_from_cli_args(original: Callable[..., Any]) -> Callable[..., Any]:
    def from_cli_args(cls: type, args: argparse.Namespace) -> Any:
        engine_args = original(cls, args)
        # Only flags the user set: the defaults change nothing, and leaving
        # additional_config alone keeps vLLM's config hash as it was.
        settings = {
            option.name: getattr(args, option.name)
            for option in OPTIONS
            if getattr(args, option.name, option.default) != option.default
        }
        if settings:
            engine_args.additional_config = merge_settings(
                engine_args.additional_config, settings
            )
        attach_chunk_connector(engine_args)
        attach_catalog_processor(engine_args)
        carry_to_namespace(args, engine_args)
        return engine_args

    return from_cli_args


CARRIED_FIELDS = ("additional_config", "kv_transfer_config", "logits_processors")
"""``EngineArgs`` fields the plugin may set from its flags; each is also a
``vllm serve`` argument, so the parsed namespace has an attribute of the same
name that upstream's ``from_cli_args`` copies."""


def carry_to_namespace(args: argparse.Namespace, engine_args: Any) -> None:
    """Writes what the plugin folded into ``engine_args`` back onto ``args``.

    Why: ``vllm serve --api-server-count N`` (and ``--data-parallel-size N``,
    which defaults N API servers) spawns each API-server process with this
    namespace, and there ``AsyncEngineArgs.from_cli_args(args)`` runs before
    any general plugin is loaded (``EngineArgs.__post_init__`` loads them),
    so the unpatched original would drop the plugin's flags. Written onto
    vLLM's own fields, the settings travel as a user's ``--additional-config``
    would. Idempotent: folding the namespace again gives the same values.
    """
    namespace = vars(args)
    for name in CARRIED_FIELDS:
        if name in namespace:
            namespace[name] = getattr(engine_args, name)


def wrap_engine_args_init(original: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        settings = {
            name: kwargs.pop(name) for name in list(kwargs) if name in OPTIONS_BY_NAME
        }
        if settings:
            kwargs["additional_config"] = merge_settings(
                kwargs.get("additional_config"), settings
            )
        original(self, *args, **kwargs)
        attach_chunk_connector(self)
        attach_catalog_processor(self)

    return __init__
