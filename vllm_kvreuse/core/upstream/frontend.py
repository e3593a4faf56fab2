"""The seam to the API server's and engine client's private state.

Two reads no public method offers: the LoRA adapter an OpenAI serving
object runs a request with, and how many API-server processes stand in
front of an engine. Each is registered in
:data:`vllm_kvreuse.patches.upstream_state.UPSTREAM_STATE`.
"""

from __future__ import annotations

from typing import Any


def lora_request_of(serving: Any, request: Any) -> Any:
    """The LoRA adapter an OpenAI serving object runs ``request`` with (None:
    the base model); raises vLLM's not-found error for an unknown model."""
    return serving._maybe_get_adapters(request)


def api_process_count(parallel_config: Any) -> int:
    """API-server processes in front of this engine (1 unless
    ``--api-server-count`` or data parallelism started more)."""
    return parallel_config._api_process_count
