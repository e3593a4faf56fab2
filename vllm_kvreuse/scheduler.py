"""The scheduler class vLLM builds: its own choice, with the hook layer in front.

``SchedulerConfig.get_scheduler_cls`` (patched: :func:`wrap_get_scheduler_cls`)
still picks ``Scheduler``, ``AsyncScheduler``, a user's or a platform's
class. When a feature is switched on (the ``VllmConfig.__post_init__`` patch
records which on the scheduler config, :data:`FEATURES_ATTR`), that choice
comes back as :func:`scheduler_class` of it; otherwise untouched.

The hook layer (:mod:`vllm_kvreuse.core.layer`) reads the plugin's
settings off the ``VllmConfig``, which carries them parsed
(:func:`vllm_kvreuse.core.spec.settings_of`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_kvreuse.core.layer import compose

FEATURES_ATTR = "kvreuse_features"
"""Attribute the ``VllmConfig.__post_init__`` patch
(:func:`vllm_kvreuse.engine_args.wrap_vllm_config_post_init`) sets on the
scheduler config: the features switched on (absent when none is)."""


def scheduler_class(base: type) -> type:
    """``base`` with the hook layer in front (the same class for the same
    ``base``)."""
    return compose(base)


def wrap_get_scheduler_cls(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_scheduler_cls(self: Any) -> type:
        base = original(self)
        return scheduler_class(base) if getattr(self, FEATURES_ATTR, None) else base

    return get_scheduler_cls
