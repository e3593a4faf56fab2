"""The seam to the workers' private state.

One read no public attribute offers before the first forward pass: the
KV packing vLLM's CPU attention chose for a layer's cache (the device
layer reads and writes that cache in it). Registered in
:data:`vllm_kvreuse.patches.upstream_state.UPSTREAM_STATE`.
"""

from __future__ import annotations

from typing import Any


def cpu_attn_isa(dtype: Any, block_size: int, head_size: int, kv_dtype: str) -> str:
    """The packing vLLM's CPU attention chose for a layer's KV cache (it
    imports CPU-only code: call on CPU)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_size, kv_dtype)
