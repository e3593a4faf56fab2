"""Everything that touches a KV tensor: layouts, chunk moves, kernels.

:func:`build_ops` is called once per worker when vLLM registers its KV
caches; it reads each layer's layout from the attention backend vLLM chose
and returns the :class:`~vllm_kvreuse.device.base.DeviceOps` for this
platform. Nothing outside this folder indexes a KV cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_kvreuse.device.base import DeviceOps, PagedKV, Rope, UnsupportedKVLayout
from vllm_kvreuse.device.layouts import layer_views
from vllm_kvreuse.device.torch_ops import TorchOps

__all__ = [
    "DeviceOps",
    "PagedKV",
    "Rope",
    "UnsupportedKVLayout",
    "build_ops",
]


def build_ops(
    kv_caches: Mapping[str, Any],
    forward_context: Mapping[str, Any],
    block_size: int,
    rope: Rope | None,
) -> DeviceOps:
    """The device ops over ``kv_caches`` (layer name -> cache, as vLLM
    registers them), in registration order."""
    from vllm.platforms import current_platform

    if current_platform.device_type == "npu":  # vllm-ascend's platform
        from vllm_kvreuse.device.npu import build_ascend_ops

        return build_ascend_ops(kv_caches, block_size, rope)
    layers = [
        layer_views(forward_context[name], cache, block_size)
        for name, cache in kv_caches.items()
    ]
    return TorchOps(layers, rope)
