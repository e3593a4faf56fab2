"""CPU workers bind their OpenMP threads as if no KV connector were set,
when the connector is one of this plugin's.

On CPU, vLLM's ``OMPProcessManager`` keeps some cores free of the workers'
OpenMP threads (one per worker, for the engine core, which busy-polls the
workers' replies) and, whenever ``kv_transfer_config`` is set, one more per
worker for a transfer connector's background threads (NIXL in P/D). The
plugin's connectors (today the chunk cache's) compute on no thread of their
own: their loads run on the worker's thread before the forward pass and
their saves after it; their one background thread, with a disk tier or a
shared store set, writes files and network messages, waiting on I/O. The
extra reservation only costs the model cores; and where it cannot
be met (two cores per worker), vLLM reserves none at all, so the worker's
OpenMP threads share every core with the polling engine core. On a 2-core
machine that made every step of every request about 4 times slower with
``--enable-chunk-cache`` (docs/results/chunk_cache.md, "Cost when unused").

The registered patch on ``OMPProcessManager.__init__`` therefore hands it a
view of the config without a KV connector when the connector is the
plugin's, alone: the cores are bound exactly as plain vLLM binds them. Any
other connector (the user's own, or the chunk cache inside a
``MultiConnector``) gets vLLM's reservation unchanged, and
``VLLM_CPU_NUM_OF_RESERVED_CPU``, which vLLM applies after its own count,
still overrides both.

Invariant this relies on: a KV connector of this package
(``kv_connector_module_path`` under ``vllm_kvreuse``) starts no thread that
computes.
Platform code, not a feature's: it names no feature and imports nothing of
the plugin.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

PLUGIN_PACKAGE = __name__.split(".")[0]
"""``vllm_kvreuse``: the package whose connectors start no computing thread."""


def is_plugin_connector(kv_transfer_config: Any) -> bool:
    """Whether the configured connector, alone, is one of this plugin's
    (named by module path, as the chunk cache configures its own)."""
    path = kv_transfer_config.kv_connector_module_path if kv_transfer_config else None
    return bool(path) and path.split(".")[0] == PLUGIN_PACKAGE


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
        if is_plugin_connector(getattr(config, "kv_transfer_config", None)):
            config = WithoutKVConnector(config)
        original(self, config)

    return __init__
