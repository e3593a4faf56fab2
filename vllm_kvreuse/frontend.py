"""Frontend wrappers shared by several features (registered in patches.py).

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

from vllm_kvreuse.admission import frontend as admission
from vllm_kvreuse.chunk_cache import frontend as chunks
from vllm_kvreuse.continuation import frontend as continuation

PROMPTLESS_FIELDS = (continuation.CONTINUATION_OF, chunks.BODY_FIELD)
"""Body fields that stand in for ``prompt`` on /v1/completions."""


def validate_extra_args(extra_args: dict[str, Any]) -> None:
    """Raises ``VLLMValidationError`` (HTTP 400) for a bad plugin option."""
    for validate in (admission.validate_extra_args, continuation.validate_extra_args):
        try:
            validate(extra_args)
        except ValueError as e:
            raise VLLMValidationError(str(e)) from None


def wrap_to_sampling_params(original: Callable[..., Any]) -> Callable[..., Any]:
    """Copies the plugin's top-level body fields into ``extra_args``."""

    def to_sampling_params(self: Any, *args: Any, **kwargs: Any) -> SamplingParams:
        params = original(self, *args, **kwargs)
        body = self.model_extra or {}
        fields = {
            name: body[name]
            for name in (*admission.BODY_FIELDS, *continuation.BODY_FIELDS)
            if body.get(name) is not None
        }
        if fields:
            extra_args = {**(params.extra_args or {}), **fields}
            validate_extra_args(extra_args)
            params.extra_args = extra_args
        return params

    return to_sampling_params


def wrap_validate_params(original: Callable[..., Any]) -> Callable[..., Any]:
    def _validate_params(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, params, *args, **kwargs)
        if isinstance(params, SamplingParams) and params.extra_args:
            validate_extra_args(params.extra_args)
        return result

    return _validate_params


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
        given = request.prompt not in (None, "", [])
        result = await continuation.render_continuation(self, request, given)
        if result is None:
            result = await chunks.render_chunked(self, request)
        return result if result is not None else await original(self, request)

    return render_completion_request


def promptless_completion_request(original: type) -> type:
    """``CompletionRequest`` that accepts a body whose prompt comes from
    ``continuation_of`` or ``chunks``; the renderers above check it."""

    class CompletionRequest(original):  # type: ignore[misc, valid-type]
        __doc__ = original.__doc__
        __module__ = original.__module__
        __qualname__ = original.__qualname__

        @model_validator(mode="before")
        @classmethod
        def validate_prompt_and_prompt_embeds(cls, data: Any) -> Any:
            if isinstance(data, dict) and any(
                data.get(name) is not None for name in PROMPTLESS_FIELDS
            ):
                return data
            return original.validate_prompt_and_prompt_embeds(data)

    return CompletionRequest
