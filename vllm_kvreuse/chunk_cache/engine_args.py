"""The chunk cache's engine arguments: its KV connector, alone or beside a user's.

Called through the chunk cache's spec (:mod:`vllm_kvreuse.chunk_cache.spec`)
by the generic wrappers in :mod:`vllm_kvreuse.engine_args` and by
:func:`vllm_kvreuse.register`.
"""

from __future__ import annotations

from typing import Any

from vllm_kvreuse.core.spec import Settings

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


def attach_chunk_connector(engine_args: Any, settings: Settings) -> None:
    """Puts the chunk-cache connector in ``kv_transfer_config`` when enabled.

    Without a user connector it takes the slot alone. Beside one
    (``--kv-transfer-config``), both go into vLLM's ``MultiConnector``, the
    chunk cache first: MultiConnector loads from the first child reporting
    hits, and the chunk cache reports hits only for its chunked requests
    (0 for every other), so a chunked request always loads its planned
    chunks and an ordinary one is answered by the user's connector. Every
    child sees every save. Idempotent: a config that already has the chunk
    connector is left as it is. Alone, failed loads are recomputed
    (``kv_load_failure_policy``); beside a user's connector the user's
    policy stands (vLLM's default, ``fail``, fails a request whose chunk a
    tier lost).
    """
    from vllm.config import KVTransferConfig

    if not settings.enable_chunk_cache:
        return
    current = engine_args.kv_transfer_config
    if has_chunk_connector(current):
        return
    if current is None:
        # A chunk a tier cannot give (a damaged file, the shared store down)
        # fails its load: vLLM then recomputes the request from there.
        engine_args.kv_transfer_config = KVTransferConfig(
            **CHUNK_CHILD, kv_load_failure_policy="recompute"
        )
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
