"""CPU workers bind their OpenMP threads as if no KV connector were set.

On CPU, vLLM's ``OMPProcessManager`` keeps some cores free of the workers'
OpenMP threads (one per worker, for the engine core, which busy-polls the
workers' replies) and, whenever ``kv_transfer_config`` is set, one more per
worker for a transfer connector's background threads (NIXL in P/D). The
chunk-cache connector has no background thread: its loads run on the
worker's thread before the forward pass and its saves after it. The extra
reservation only costs the model cores; and where it cannot be met (two
cores per worker), vLLM reserves none at all, so the worker's OpenMP threads
share every core with the polling engine core. On a 2-core machine that made
every step of every request about 4 times slower with ``--enable-chunk-cache``
(docs/chunk_cache.md, "Cost when unused").

The registered patch on ``OMPProcessManager.__init__`` therefore hands it a
view of the config without a KV connector when the connector is the chunk
cache's: the cores are bound exactly as plain vLLM binds them. Any other
connector (the user's own, or the chunk cache inside a ``MultiConnector``)
gets vLLM's reservation unchanged, and ``VLLM_CPU_NUM_OF_RESERVED_CPU``, which
vLLM applies after its own count, still overrides both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_kvreuse.chunk_cache.engine_args import CHUNK_CONNECTOR, CHUNK_CONNECTOR_MODULE


def is_chunk_connector(kv_transfer_config: Any) -> bool:
    """Whether the configured connector is the chunk cache's, alone."""
    return (
        kv_transfer_config is not None
        and kv_transfer_config.kv_connector == CHUNK_CONNECTOR
        and kv_transfer_config.kv_connector_module_path == CHUNK_CONNECTOR_MODULE
    )


class WithoutKVConnector:
    """Read-only view of a ``VllmConfig`` whose ``kv_transfer_config`` is None.

    Every other attribute is the config's own, read through at access time,
    so the view never goes stale; nothing can be set on it.
    """

    __slots__ = ("_config",)

    def __init__(self, config: Any) -> None:
        object.__setattr__(self, "_config", config)

    def __getattr__(self, name: str) -> Any:
        if name == "kv_transfer_config":
            return None
        return getattr(object.__getattribute__(self, "_config"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a WithoutKVConnector view is read-only")


def wrap_omp_manager_init(original: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, config: Any) -> None:
        if is_chunk_connector(getattr(config, "kv_transfer_config", None)):
            config = WithoutKVConnector(config)
        original(self, config)

    return __init__
