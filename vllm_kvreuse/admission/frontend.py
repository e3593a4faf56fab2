"""Frontend side of the cache-hit threshold: request field in, finish reason out.

Runs in the API-server process (or the ``LLM`` caller's process). Registered
in :mod:`vllm_kvreuse.patches`:
- ``to_sampling_params``: the HTTP body's top-level ``cache_hit_threshold``
  goes into ``SamplingParams.extra_args`` (the engine's only input);
- ``_validate_params``: a bad value in ``extra_args`` fails before the
  request reaches the engine, online and offline;
- ``_new_completion_output``: the engine's (ABORT, "cache_threshold") pair
  becomes ``finish_reason="cache_threshold"``, and is counted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import FinishReason

from vllm_kvreuse.admission.policy import FINISH_REASON, REQUEST_FIELD, parse_threshold
from vllm_kvreuse.metrics import count_cache_threshold_rejection


def validated_threshold(value: Any) -> float:
    """``parse_threshold`` raising vLLM's 400-mapped validation error."""
    try:
        return parse_threshold(value)
    except ValueError as e:
        raise VLLMValidationError(
            str(e), parameter=REQUEST_FIELD, value=value
        ) from None


def wrap_to_sampling_params(original: Callable[..., Any]) -> Callable[..., Any]:
    def to_sampling_params(self: Any, *args: Any, **kwargs: Any) -> SamplingParams:
        params = original(self, *args, **kwargs)
        value = (self.model_extra or {}).get(REQUEST_FIELD)
        if value is not None:
            extra_args = dict(params.extra_args or {})
            extra_args[REQUEST_FIELD] = validated_threshold(value)
            params.extra_args = extra_args
        return params

    return to_sampling_params


def wrap_validate_params(original: Callable[..., Any]) -> Callable[..., Any]:
    def _validate_params(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, params, *args, **kwargs)
        if isinstance(params, SamplingParams) and params.extra_args:
            value = params.extra_args.get(REQUEST_FIELD)
            if value is not None:
                validated_threshold(value)
        return result

    return _validate_params


def wrap_new_completion_output(original: Callable[..., Any]) -> Callable[..., Any]:
    def _new_completion_output(
        self: Any, token_ids: list[int], finish_reason: Any, stop_reason: Any
    ) -> Any:
        output = original(self, token_ids, finish_reason, stop_reason)
        if finish_reason == FinishReason.ABORT and stop_reason == FINISH_REASON:
            output.finish_reason = FINISH_REASON
            detokenizer = self.detokenizer
            preempted = detokenizer is not None and detokenizer.num_output_tokens() > 0
            count_cache_threshold_rejection(preempted)
        return output

    return _new_completion_output
