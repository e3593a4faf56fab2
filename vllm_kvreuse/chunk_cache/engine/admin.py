"""Engine-core side of the chunk cache's admin endpoint
(:mod:`vllm_kvreuse.chunk_cache.frontend.admin`).

The store index lives in the engine core's scheduler; the endpoint plugin
reaches it through this engine-core utility (``call_utility_async``),
installed by the patch registry. What it returns leaves the engine core for
an HTTP client, so the shared store's URL goes out redacted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_kvreuse.chunk_cache.tiers.urls import redact_url

UTILITY = "kvreuse_chunk_cache"


def make_chunk_cache_utility(_: None) -> Callable[..., dict[str, Any]]:
    def kvreuse_chunk_cache(
        self: Any, action: str, chunk: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Engine-core utility behind the admin endpoint: ``action`` on the
        chunk ``chunk`` names (the endpoint's validated body, for pin and
        unpin), in :meth:`.store.ChunkStore.admin`."""
        find = getattr(self.scheduler, "feature", None)
        feature = find("chunk_cache") if find is not None else None
        if feature is None:
            raise ValueError("the chunk cache is not enabled on this server")
        result = feature.admin(action, **(chunk or {}))
        if result.get("shared_store"):  # its password stays in the engine
            result["shared_store"] = redact_url(result["shared_store"])
        return result

    return kvreuse_chunk_cache
