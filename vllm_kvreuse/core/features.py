"""Which features run, and in what order the layer calls them.

The order matters only for broadcast hooks that touch the same request:
- ``on_add``: the chunk cache first, because it re-salts a chunked request
  (its block hashes change) before anyone reads them;
- ``release_under_pressure``: beam search's held beams go before retained
  parents (a beam is needed for one more step, a parent maybe never).
Exclusive hooks have one implementer by construction (tested).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_kvreuse.admission.feature import CacheHitThreshold
from vllm_kvreuse.beam.feature import EngineBeamSearch
from vllm_kvreuse.chunk_cache.feature import ChunkCache
from vllm_kvreuse.continuation.feature import Continuation

if TYPE_CHECKING:
    from vllm_kvreuse.core.context import Core
    from vllm_kvreuse.core.feature import Feature

FEATURE_ORDER: tuple[type[Feature], ...] = (
    ChunkCache,
    CacheHitThreshold,
    EngineBeamSearch,
    Continuation,
)
"""Every feature, in hook-call order; ``name`` matches its config switch."""


def build_features(core: Core) -> list[Feature]:
    """The enabled features, in :data:`FEATURE_ORDER`."""
    enabled = core.config.enabled
    return [cls(core) for cls in FEATURE_ORDER if cls.name in enabled]
