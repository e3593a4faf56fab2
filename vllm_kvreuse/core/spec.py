"""What a feature declares about itself: one :class:`FeatureSpec` per folder.

Each feature folder exports ``SPEC`` from its ``spec.py``; the top floor
(:mod:`vllm_kvreuse.features`) lists them, and the shared tables
(:mod:`vllm_kvreuse.config`, :mod:`vllm_kvreuse.request_args`, the hook
layer, the engine arguments, the frontend wrappers) loop over that list. A
spec module imports only light modules (its parsers):
:mod:`vllm_kvreuse.config` imports it while it is being built, so the
scheduler feature class and every hook are named by path
(``"module:attr"``) and imported when first needed (:func:`hooks`).

The settings built from the specs' options (:class:`Settings`) are the top
floor's (:class:`vllm_kvreuse.config.KVReuseConfig`): parsed once, where a
process builds its ``VllmConfig`` (the ``VllmConfig.__post_init__`` patch),
and carried by it to every process vLLM hands it to; everything below the
top floor reads them off it with :func:`settings_of` and imports neither
them nor the list.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from vllm_kvreuse.core.options import Option


class Settings(Protocol):
    """The plugin's settings as core sees them: one attribute per option of
    every spec (read by the features that declared them), and the specs of
    the features they switch on."""

    @property
    def features(self) -> tuple[FeatureSpec, ...]:
        """The specs of the features switched on, in hook-call order."""
        ...

    def __getattr__(self, name: str) -> Any:
        """An option's value (``core.config.retain_kv_ttl``)."""
        ...


def settings_of(vllm_config: Any) -> Settings:
    """The plugin's settings that ``vllm_config`` carries: parsed once when
    it was built (``VllmConfig.__post_init__``, patched by
    :mod:`vllm_kvreuse.engine_args`), not again on each call."""
    settings = getattr(vllm_config, "kvreuse_settings", None)
    if settings is None:
        raise RuntimeError(
            "this VllmConfig carries no vllm-kvreuse settings: it was built "
            "before the plugin was loaded (call vllm_kvreuse.register() first)"
        )
    return settings


@dataclass(frozen=True, slots=True)
class ArgKey:
    """One ``extra_args`` key: who reads it, who may set it, how it is checked.

    ``owner`` is the spec name of the feature that reads it, or ``core``.
    An internal key (not ``public``) is defined in
    :mod:`vllm_kvreuse.core.request_keys`, which seals what the plugin writes.

    ``parse`` checks a value (``ValueError``, ``TypeError``) and returns it
    as the engine reads it: plain data (it crosses processes in
    ``extra_args``), the same when parsed again. The frontend's validation
    (:func:`vllm_kvreuse.request_args.validate`) carries it in the request's
    ``extra_args``: the one parse a key gets; the engine reads what it
    carries as it is.
    """

    name: str
    owner: str
    public: bool
    parse: Callable[[Any], Any]
    doc: str
    inherited: bool = False
    """A child request (a continuation) carries its parent's value: the
    parent's owner decides, the child's builder copies what is marked."""


@dataclass(frozen=True, slots=True)
class FeatureSpec:
    """One feature: its settings, request keys, switch, scheduler class and
    the engine and frontend hooks it needs (empty: none).

    Invariants (checked here): ``switch`` names one of ``options``, every key
    is owned by ``name``. The feature is on when its switch setting is
    neither ``None`` nor ``False`` (so a threshold of 0 is on).
    """

    name: str
    options: tuple[Option, ...]
    keys: tuple[ArgKey, ...]
    switch: str
    """The option that turns the feature on."""
    feature: str
    """``"module:Class"`` of its :class:`~vllm_kvreuse.core.feature.Feature`
    (imported by :func:`vllm_kvreuse.core.features.feature_class`)."""
    switch_note: str = ""
    """Said after the switch's flag when a request needs the feature off."""
    attach_engine_args: str = ""
    """``"module:function"`` given the ``EngineArgs`` once the settings are
    folded in, and those settings, whether the feature is on or not (it
    checks)."""
    finalize_vllm_config: str = ""
    """``"module:function"`` given the finished ``VllmConfig`` (its settings:
    :func:`settings_of`)."""
    on_register: str = ""
    """``"module:function"`` called when the plugin loads, in every process."""

    # Frontend hooks (API-server or ``LLM`` process), called by
    # :mod:`vllm_kvreuse.frontend`.
    promptless_fields: tuple[str, ...] = ()
    """Body fields that stand in for ``prompt`` on /v1/completions (the
    feature's renderer builds the prompt from them)."""
    check_body: str = ""
    """``"module:function"`` given a completion or chat request body (before
    pydantic reads it, so JSON types are still visible); raises
    ``ValueError`` (HTTP 400) to refuse it."""
    to_beam_search_params: str = ""
    """``"module:function"`` given a request model and the
    ``BeamSearchParams`` vLLM built from it; returns them, marked."""
    render_completion: str = ""
    """``"module:coroutine"`` given the serving object and a completion
    request: its engine inputs (a list; the wrapper then runs vLLM's model
    check, as the unpatched renderer does), an error object, or None (not
    this feature's request)."""
    render_chat: str = ""
    """The same as ``render_completion``, for a chat request."""
    render_order: int = 0
    """Renderers run lowest first, ties in list order; the first that
    answers other than None renders the request."""
    on_final_output: str = ""
    """``"module:function"`` given ``(request_state, output, finish_reason,
    stop_reason)`` when a request's final output is built, in list order."""

    def __post_init__(self) -> None:
        names = [option.name for option in self.options]
        assert self.switch in names, f"{self.name}: switch {self.switch} unknown"
        stray = [key.name for key in self.keys if key.owner != self.name]
        assert not stray, f"{self.name}: keys owned elsewhere {stray}"

    @property
    def enabling_flag(self) -> str:
        """The flag (and how to use it) that a refused request is told of."""
        flag = "--" + self.switch.replace("_", "-")
        return f"{flag} ({self.switch_note})" if self.switch_note else flag

    def is_on(self, settings: Any) -> bool:
        """Whether ``settings`` (a :class:`~vllm_kvreuse.config.KVReuseConfig`)
        switches this feature on."""
        value = getattr(settings, self.switch)
        return value is not None and value is not False


def load_hook(path: str) -> Any:
    """Imports ``"module:attr"`` and returns the attribute."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def hooks(specs: Iterable[FeatureSpec], field: str) -> list[Callable[..., Any]]:
    """Each spec's ``field`` hook (a ``"module:function"`` path), imported,
    in ``specs`` order; specs that leave it empty are passed over."""
    return [load_hook(path) for spec in specs if (path := getattr(spec, field))]


def inherited_keys(specs: Iterable[FeatureSpec]) -> frozenset[str]:
    """The request keys of ``specs`` that a child carries from its parent."""
    return frozenset(key.name for spec in specs for key in spec.keys if key.inherited)
