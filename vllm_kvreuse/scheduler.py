"""Composes the plugin's scheduler from vLLM's choice plus feature mixins.

vLLM picks ``Scheduler`` or ``AsyncScheduler`` (or the user's
``scheduler_cls``) in ``SchedulerConfig.get_scheduler_cls``; the registered
patch passes that choice through :func:`compose`, which puts each feature's
mixin in front of it. Every mixin subclasses upstream ``Scheduler`` and calls
``super()``, so the chain ends in vLLM's own code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_kvreuse.admission.scheduler import CacheHitThresholdMixin
from vllm_kvreuse.beam.scheduler import BeamSearchMixin
from vllm_kvreuse.chunk_cache.scheduler import ChunkCacheMixin
from vllm_kvreuse.continuation.scheduler import ContinuationMixin

logger = init_logger(__name__)

# Order: ChunkCacheMixin comes first so that its num_cache_hit_tokens (stored
# chunks count as hits) answers the threshold check; the threshold check asks
# _get_local_prefix_cache_hit, which ContinuationMixin answers for children;
# BeamSearchMixin builds on ContinuationMixin (it holds beams' blocks) and
# filters member outputs before the threshold mixin appends its rejections.
SCHEDULER_MIXINS: tuple[type[Scheduler], ...] = (
    ChunkCacheMixin,
    CacheHitThresholdMixin,
    BeamSearchMixin,
    ContinuationMixin,
)


@functools.cache
def compose(base: type) -> type:
    """Returns ``base`` with the plugin's mixins in front (cached per base)."""
    if all(issubclass(base, mixin) for mixin in SCHEDULER_MIXINS):
        return base
    if not issubclass(base, Scheduler):
        logger.warning(
            "vllm-kvreuse: scheduler class %s does not derive from vLLM's "
            "Scheduler; the plugin's scheduler features are off.",
            base.__qualname__,
        )
        return base
    return type(
        f"KVReuse{base.__name__}",
        (*SCHEDULER_MIXINS, base),
        {"__module__": __name__, "__doc__": f"{base.__qualname__} with vllm-kvreuse."},
    )


def wrap_get_scheduler_cls(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_scheduler_cls(self: Any) -> type:
        return compose(original(self))

    return get_scheduler_cls
