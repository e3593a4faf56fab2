"""vllm-kvreuse settings: one table of options, one frozen config object.

Settings travel to every process inside vLLM's own config, as
``VllmConfig.additional_config["kvreuse"]``: the API server folds the
``vllm serve`` flags (or ``LLM(...)`` keyword arguments) into it. They are
parsed once, with :meth:`KVReuseConfig.from_vllm_config`, where a process
builds its ``VllmConfig`` (the ``VllmConfig.__post_init__`` patch,
:mod:`vllm_kvreuse.engine_args`), which then carries the parsed object to
every process it is handed to (engine cores, workers); the features read it
off the config (:func:`vllm_kvreuse.core.spec.settings_of`) and never import
this module. No environment variable is involved.

Every setting is declared by its feature's spec
(:class:`~vllm_kvreuse.core.spec.FeatureSpec`); this module loops over
:data:`vllm_kvreuse.features.SPECS` (below it) and names no feature.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, field, make_dataclass
from typing import Any

from vllm_kvreuse.core.options import (  # re-exported: documented import paths
    Option,
    choice_parser,
    parse_bool,
    parse_fraction,
    parse_gib,
    parse_seconds,
    parse_separator,
    parse_tokens,
)
from vllm_kvreuse.core.spec import FeatureSpec
from vllm_kvreuse.features import SPECS

__all__ = [
    "ADDITIONAL_CONFIG_KEY",
    "OPTIONS",
    "OPTIONS_BY_NAME",
    "KVReuseConfig",
    "Option",
    "choice_parser",
    "merge_settings",
    "parse_bool",
    "parse_fraction",
    "parse_gib",
    "parse_seconds",
    "parse_separator",
    "parse_tokens",
]

ADDITIONAL_CONFIG_KEY = "kvreuse"


class _Settings:
    """The methods of :class:`KVReuseConfig`; its fields come from the specs."""

    __slots__ = ()

    specs: tuple[FeatureSpec, ...]
    """The features whose options are the fields (class attribute)."""
    options_by_name: dict[str, Option]
    """Those options by name (class attribute)."""

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Any:
        """Validates ``raw`` (the additional_config entry); unknown keys are errors."""
        known = cls.options_by_name
        unknown = set(raw) - set(known)
        if unknown:
            raise ValueError(
                f"unknown vllm-kvreuse setting(s) {sorted(unknown)} in "
                f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]; "
                f"known: {sorted(known)}"
            )
        values = {
            name: known[name].parse(value, name)
            for name, value in raw.items()
            if value is not None
        }
        return cls(**values)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> Any:
        """Reads the settings the frontend stored in ``vllm_config``."""
        additional = getattr(vllm_config, "additional_config", None) or {}
        if not isinstance(additional, Mapping):
            return cls()
        return cls.from_dict(additional.get(ADDITIONAL_CONFIG_KEY) or {})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @property
    def features(self) -> tuple[FeatureSpec, ...]:
        """The specs of the features switched on, in hook-call order."""
        return tuple(spec for spec in self.specs if spec.is_on(self))

    @property
    def enabled(self) -> frozenset[str]:
        """The names of the features switched on (``core`` is always there)."""
        return frozenset({"core"} | {spec.name for spec in self.features})


def settings_class(specs: tuple[FeatureSpec, ...]) -> Any:
    """A frozen settings class with one field per option of ``specs``, in
    their order, each with its default (:class:`KVReuseConfig` is the one for
    :data:`~vllm_kvreuse.features.SPECS`)."""
    options = tuple(option for spec in specs for option in spec.options)
    by_name = {option.name: option for option in options}
    assert len(by_name) == len(options), "two options share a name"
    return make_dataclass(
        "KVReuseConfig",
        [(option.name, Any, field(default=option.default)) for option in options],
        bases=(_Settings,),
        namespace={
            "__module__": __name__,  # so pickle and docs find it here
            "__doc__": "Validated vllm-kvreuse settings, one field per option in "
            ":data:`OPTIONS` with its default; defaults change nothing in vLLM.",
            "specs": specs,
            "options_by_name": by_name,
        },
        frozen=True,
        slots=True,
    )


KVReuseConfig = settings_class(SPECS)
OPTIONS_BY_NAME: dict[str, Option] = KVReuseConfig.options_by_name
OPTIONS: tuple[Option, ...] = tuple(OPTIONS_BY_NAME.values())
"""Every setting, feature by feature in :data:`~vllm_kvreuse.features.SPECS`."""


def merge_settings(
    additional_config: Mapping[str, Any] | None, settings: Mapping[str, Any]
) -> dict[str, Any]:
    """Returns a copy of ``additional_config`` with ``settings`` folded in.

    ``settings`` override entries the user put in
    ``additional_config["kvreuse"]`` directly. The result is validated, so a
    bad value fails here, at start-up, naming the setting.
    """
    merged = dict(additional_config or {})
    ours = {**(merged.get(ADDITIONAL_CONFIG_KEY) or {}), **settings}
    KVReuseConfig.from_dict(ours)  # validates
    merged[ADDITIONAL_CONFIG_KEY] = {
        name: OPTIONS_BY_NAME[name].parse(value, name)
        for name, value in ours.items()
        if value is not None
    }
    return merged
