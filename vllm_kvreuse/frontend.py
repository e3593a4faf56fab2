"""Frontend wrappers shared by several features (registered in patches/serving.py).

Each upstream function is wrapped once; the wrapper hands the call to every
feature that needs it, in a fixed order. Runs in the API-server process or
the ``LLM`` caller's process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import model_validator
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams

from vllm_kvreuse import request_args
from vllm_kvreuse.admission import frontend as admission
from vllm_kvreuse.beam import frontend as beam_frontend
from vllm_kvreuse.chunk_cache import frontend as chunks
from vllm_kvreuse.config import KVReuseConfig
from vllm_kvreuse.continuation import frontend as continuation

PROMPTLESS_FIELDS = (continuation.CONTINUATION_OF, chunks.BODY_FIELD)
"""Body fields that stand in for ``prompt`` on /v1/completions."""


def validate_extra_args(extra_args: dict[str, Any] | None, vllm_config: Any) -> None:
    """Raises ``VLLMValidationError`` (HTTP 400) for a bad plugin key."""
    enabled = KVReuseConfig.from_vllm_config(vllm_config).enabled
    try:
        request_args.validate(extra_args, enabled)  # type: ignore[arg-type]
    except request_args.BadRequestArgs as e:
        raise VLLMValidationError(str(e), parameter=e.param) from None


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
    """Every request, HTTP or offline, passes the plugin's key table."""

    def _validate_params(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, params, *args, **kwargs)
        if isinstance(params, SamplingParams) and params.extra_args:
            validate_extra_args(params.extra_args, self.vllm_config)
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
            admission.on_final_output(self, output, finish_reason, stop_reason)
            continuation.on_final_output(self, output)
        return output

    return _new_completion_output


def wrap_render_completion_request(original: Callable[..., Any]) -> Callable[..., Any]:
    """A continuation, then a chunked prompt, may render the request; else vLLM."""

    async def render_completion_request(self: Any, request: Any) -> Any:
        if (error := client_key_error(self, request)) is not None:
            return error
        given = request.prompt not in (None, "", [])
        result = await continuation.render_continuation(self, request, given)
        if result is None:
            result = await chunks.render_chunked(self, request)
        return result if result is not None else await original(self, request)

    return render_completion_request


def wrap_render_chat_request(original: Callable[..., Any]) -> Callable[..., Any]:
    """A continuation may render a chat request (no chat template); else vLLM."""

    async def render_chat_request(self: Any, request: Any) -> Any:
        if (error := client_key_error(self, request)) is not None:
            return error
        given = bool(request.messages)
        result = await continuation.render_continuation(self, request, given)
        if result is None:
            return await original(self, request)
        # Chat returns (conversation, inputs); a continuation has no messages.
        return ([], result) if isinstance(result, list) else result

    return render_chat_request


SID_CATALOG = "sid_catalog"
"""Body field: constrain the beams to the server's SID catalog."""

STRICT_BOOLS = ("use_beam_search", SID_CATALOG)
"""Body fields that must be JSON booleans: pydantic would read ``"yes"`` as
true, and engine-side beam search then serves a request the client may not
have meant."""


def check_strict_bools(data: Any) -> Any:
    if isinstance(data, dict):
        for name in STRICT_BOOLS:
            value = data.get(name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}")
        if data.get(SID_CATALOG) and not data.get("use_beam_search"):
            raise ValueError(f"{SID_CATALOG} applies to use_beam_search requests")
    return data


def mark_catalog(request: Any, params: Any) -> Any:
    """Carries the body's ``sid_catalog``, and the parent a continuation
    resolved to, into the ``BeamSearchParams``."""
    if (request.model_extra or {}).get(SID_CATALOG):
        beam_frontend.mark_catalog_params(params)
    parent = (getattr(request, "vllm_xargs", None) or {}).get(request_args.PARENT)
    if parent is not None:
        beam_frontend.mark_parent_params(params, parent)
    return params


def _request_model(original: type, **namespace: Any) -> type:
    """A subclass of the pydantic request model ``original`` that checks the
    plugin's strict booleans and carries ``sid_catalog`` into beam params."""

    def kvreuse_strict_bools(cls: type, data: Any) -> Any:
        return check_strict_bools(data)

    def to_beam_search_params(self: Any, *args: Any, **kwargs: Any) -> Any:
        params = original.to_beam_search_params(self, *args, **kwargs)
        return mark_catalog(self, params)

    return type(
        original.__name__,
        (original,),
        {
            "__doc__": original.__doc__,
            "__module__": original.__module__,
            "__qualname__": original.__qualname__,
            "kvreuse_strict_bools": model_validator(mode="before")(
                classmethod(kvreuse_strict_bools)
            ),
            "to_beam_search_params": to_beam_search_params,
            **namespace,
        },
    )


def strict_chat_completion_request(original: type) -> type:
    """``ChatCompletionRequest`` whose ``use_beam_search`` must be a boolean."""
    return _request_model(original)


def promptless_completion_request(original: type) -> type:
    """``CompletionRequest`` that accepts a body whose prompt comes from
    ``continuation_of`` or ``chunks`` (the renderers above check it), and
    whose ``use_beam_search`` must be a boolean."""

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
