"""Frontend wrappers shared by several features (registered in patches/serving.py).

Each upstream function is wrapped once; the wrapper hands the call to every
feature whose spec (:class:`~vllm_kvreuse.core.spec.FeatureSpec`) has the
matching frontend hook, in :data:`~vllm_kvreuse.features.SPECS` order
(renderers in ``render_order``). Names no feature. Runs in the API-server
process or the ``LLM`` caller's process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from pydantic import model_validator
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams

from vllm_kvreuse import request_args
from vllm_kvreuse.core.spec import FeatureSpec, hooks, settings_of
from vllm_kvreuse.features import SPECS

PROMPTLESS_FIELDS = tuple(name for spec in SPECS for name in spec.promptless_fields)
"""Body fields that stand in for ``prompt`` on /v1/completions."""

RENDER_ORDER: tuple[FeatureSpec, ...] = tuple(
    sorted(SPECS, key=lambda spec: spec.render_order)
)
"""The features in the order their renderers are asked (lowest
``render_order`` first, ties in list order)."""


@functools.cache
def _hooks(field: str) -> tuple[Callable[..., Any], ...]:
    """The specs' ``field`` hooks in list order, imported on first use (a
    feature's frontend imports vLLM's serving code)."""
    return tuple(hooks(SPECS, field))


@functools.cache
def _renderers(field: str) -> tuple[Callable[..., Any], ...]:
    """The specs' ``field`` renderers, in :data:`RENDER_ORDER`."""
    return tuple(hooks(RENDER_ORDER, field))


def validate_extra_args(extra_args: dict[str, Any], vllm_config: Any) -> dict[str, Any]:
    """``extra_args`` with the plugin's keys parsed, as the engine reads
    them; ``VLLMValidationError`` (HTTP 400) for a bad plugin key."""
    enabled = settings_of(vllm_config).enabled
    try:
        parsed = request_args.validate(extra_args, enabled)  # type: ignore[arg-type]
    except request_args.BadRequestArgs as e:
        raise VLLMValidationError(str(e), parameter=e.param) from None
    return {**extra_args, **parsed}


def wrap_to_sampling_params(original: Callable[..., Any]) -> Callable[..., Any]:
    """Copies the plugin's public top-level body fields into ``extra_args``.

    Fields the client sent as null are left out, as if absent.
    """

    def to_sampling_params(self: Any, *args: Any, **kwargs: Any) -> SamplingParams:
        params = original(self, *args, **kwargs)
        body = self.model_extra or {}
        fields = {
            name: body[name]
            for name in request_args.PUBLIC_FIELDS
            if body.get(name) is not None
        }
        if fields:
            params.extra_args = {**(params.extra_args or {}), **fields}
        return params

    return to_sampling_params


def wrap_validate_params(original: Callable[..., Any]) -> Callable[..., Any]:
    """Every request, HTTP or offline, passes the plugin's key table, and
    carries its keys parsed (a new dict: the caller's stays as it is)."""

    def _validate_params(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, params, *args, **kwargs)
        if isinstance(params, SamplingParams) and params.extra_args:
            params.extra_args = validate_extra_args(params.extra_args, self.vllm_config)
        return result

    return _validate_params


def client_key_error(serving: Any, request: Any) -> Any | None:
    """A 400 error object if the client's ``vllm_xargs`` names a key only the
    plugin may set; checked before the plugin adds its own."""
    try:
        request_args.check_client_keys(getattr(request, "vllm_xargs", None))
    except request_args.BadRequestArgs as e:
        return serving.create_error_response(str(e), param=e.param)
    return None


def wrap_new_completion_output(original: Callable[..., Any]) -> Callable[..., Any]:
    def _new_completion_output(
        self: Any, token_ids: list[int], finish_reason: Any, stop_reason: Any
    ) -> Any:
        output = original(self, token_ids, finish_reason, stop_reason)
        if finish_reason is not None:
            for hook in _hooks("on_final_output"):
                hook(self, output, finish_reason, stop_reason)
        return output

    return _new_completion_output


async def _render(field: str, serving: Any, request: Any) -> Any | None:
    """What the first renderer that claims ``request`` returns; else None.

    Engine inputs (a list, or chat's ``(conversation, list)``) pass vLLM's
    model check before they are returned, as the unpatched renderer's inputs
    do: its LoRA look-up and request log.
    """
    for render in _renderers(field):
        result = await render(serving, request)
        inputs = result[1] if isinstance(result, tuple) else result
        if isinstance(inputs, list):
            return await serving._check_model(request) or result
        if result is not None:
            return result
    return None


def wrap_render_completion_request(original: Callable[..., Any]) -> Callable[..., Any]:
    """A feature's renderer may render the request; else vLLM."""

    async def render_completion_request(self: Any, request: Any) -> Any:
        if (error := client_key_error(self, request)) is not None:
            return error
        result = await _render("render_completion", self, request)
        return result if result is not None else await original(self, request)

    return render_completion_request


def wrap_render_chat_request(original: Callable[..., Any]) -> Callable[..., Any]:
    """A feature's renderer may render a chat request (a continuation with
    no chat template, a chunked chat through it); else vLLM."""

    async def render_chat_request(self: Any, request: Any) -> Any:
        if (error := client_key_error(self, request)) is not None:
            return error
        result = await _render("render_chat", self, request)
        if result is None:
            return await original(self, request)
        # Chat returns (conversation, inputs); a rendered request has no messages.
        return ([], result) if isinstance(result, list) else result

    return render_chat_request


def check_body(data: Any) -> Any:
    """Each feature's strict checks of a request body (its spec's
    ``check_body``), before pydantic reads it; returns ``data``."""
    if isinstance(data, dict):
        for check in _hooks("check_body"):
            check(data)
    return data


def _request_model(original: type, **namespace: Any) -> type:
    """A subclass of the pydantic request model ``original`` that runs the
    features' body checks and marks its ``BeamSearchParams``."""

    def kvreuse_check_body(cls: type, data: Any) -> Any:
        return check_body(data)

    def to_beam_search_params(self: Any, *args: Any, **kwargs: Any) -> Any:
        params = original.to_beam_search_params(self, *args, **kwargs)
        for mark in _hooks("to_beam_search_params"):
            params = mark(self, params)
        return params

    return type(
        original.__name__,
        (original,),
        {
            "__doc__": original.__doc__,
            "__module__": original.__module__,
            "__qualname__": original.__qualname__,
            "kvreuse_check_body": model_validator(mode="before")(
                classmethod(kvreuse_check_body)
            ),
            "to_beam_search_params": to_beam_search_params,
            **namespace,
        },
    )


def strict_chat_completion_request(original: type) -> type:
    """``ChatCompletionRequest`` with the features' body checks and
    ``BeamSearchParams`` marks."""
    return _request_model(original)


def promptless_completion_request(original: type) -> type:
    """``CompletionRequest`` that accepts a body whose prompt comes from a
    :data:`PROMPTLESS_FIELDS` field (the renderers check it), with the
    features' body checks and ``BeamSearchParams`` marks."""

    def validate_prompt_and_prompt_embeds(cls: type, data: Any) -> Any:
        if isinstance(data, dict) and any(
            data.get(name) is not None for name in PROMPTLESS_FIELDS
        ):
            return data
        return original.validate_prompt_and_prompt_embeds(data)

    return _request_model(
        original,
        validate_prompt_and_prompt_embeds=model_validator(mode="before")(
            classmethod(validate_prompt_and_prompt_embeds)
        ),
    )
