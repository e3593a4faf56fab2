"""Wrappers that put the plugin's settings on vLLM's CLI and EngineArgs,
and check them on the finished ``VllmConfig``.

Flow: ``vllm serve --global-cache-hit-threshold 0.5`` (or
``LLM(..., global_cache_hit_threshold=0.5)``) → ``EngineArgs.additional_config
["kvreuse"]`` → ``VllmConfig.additional_config``, parsed once there into a
:class:`~vllm_kvreuse.config.KVReuseConfig` that the ``VllmConfig`` carries
(``kvreuse_settings``, read with :func:`~vllm_kvreuse.core.spec.settings_of`)
to every process it is handed to. Registered in :mod:`vllm_kvreuse.patches`.
Names no feature: each feature's engine hooks are in its spec
(:data:`vllm_kvreuse.features.SPECS`), and get the parsed settings.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from typing import Any

from vllm_kvreuse.config import (
    OPTIONS,
    OPTIONS_BY_NAME,
    KVReuseConfig,
    Option,
    merge_settings,
)
from vllm_kvreuse.core.spec import hooks
from vllm_kvreuse.features import SPECS


def attach_features(engine_args: Any) -> None:
    """Each feature's change to the engine arguments, once its settings are
    folded in (its spec's ``attach_engine_args``, given them parsed), in
    :data:`SPECS` order."""
    settings = KVReuseConfig.from_vllm_config(engine_args)
    for hook in hooks(SPECS, "attach_engine_args"):
        hook(engine_args, settings)


def finalize_vllm_config(vllm_config: Any) -> None:
    """What can only be settled on the finished ``VllmConfig`` (called at the
    end of its ``__post_init__``): each spec's ``finalize_vllm_config``."""
    for hook in hooks(SPECS, "finalize_vllm_config"):
        hook(vllm_config)


def register_features() -> None:
    """What each feature needs done when the plugin loads (its spec's
    ``on_register``), in every process."""
    for hook in hooks(SPECS, "on_register"):
        hook()


def wrap_vllm_config_post_init(original: Callable[..., Any]) -> Callable[..., Any]:
    def __post_init__(self: Any) -> None:
        original(self)
        # Parsed once, here: validates them at start-up, naming a bad one;
        # the config carries them to every process (core.spec.settings_of).
        settings = KVReuseConfig.from_vllm_config(self)
        self.kvreuse_settings = settings
        enabled = settings.enabled - {"core"}
        if enabled:
            # scheduler.FEATURES_ATTR: its get_scheduler_cls patch reads it.
            self.scheduler_config.kvreuse_features = enabled
        finalize_vllm_config(self)

    return __post_init__


GROUP_TITLE = "vllm-kvreuse"


def add_arguments(
    parser: argparse.ArgumentParser, options: Iterable[Option] = OPTIONS
) -> None:
    """Adds the plugin's flags (one per option) to ``parser`` once (a second
    call is a no-op)."""
    if any(group.title == GROUP_TITLE for group in parser._action_groups):
        return
    group = parser.add_argument_group(
        GROUP_TITLE, "KV-cache reuse features added by the vllm-kvreuse plugin."
    )
    for option in options:
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
        attach_features(engine_args)
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
        attach_features(self)

    return __init__
