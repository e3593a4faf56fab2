"""Frontend side of the cache-hit threshold: request field in, finish reason out.

Called from the shared wrappers in :mod:`vllm_kvreuse.frontend`:
- the HTTP body's top-level ``cache_hit_threshold`` goes into
  ``SamplingParams.extra_args`` (the engine's only input) and is validated
  there, online and offline;
- the engine's (ABORT, "cache_threshold") pair becomes
  ``finish_reason="cache_threshold"``, and is counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.v1.engine import FinishReason

from vllm_kvreuse.admission.metrics import count_cache_threshold_rejection
from vllm_kvreuse.admission.policy import FINISH_REASON, REQUEST_FIELD, parse_threshold

BODY_FIELDS = (REQUEST_FIELD,)
"""Top-level HTTP body fields copied into ``extra_args``."""


def validate_extra_args(extra_args: Mapping[str, Any]) -> None:
    if extra_args.get(REQUEST_FIELD) is not None:
        parse_threshold(extra_args[REQUEST_FIELD])


def on_final_output(
    request_state: Any, output: Any, finish_reason: Any, stop_reason: Any
) -> None:
    """Renames a rejection's finish reason and counts it."""
    if finish_reason == FinishReason.ABORT and stop_reason == FINISH_REASON:
        output.finish_reason = FINISH_REASON
        detokenizer = request_state.detokenizer
        preempted = detokenizer is not None and detokenizer.num_output_tokens() > 0
        count_cache_threshold_rejection(preempted)
