"""Everything that touches a KV tensor: layouts, chunk moves, kernels.

:func:`build_ops` is called once per worker when vLLM registers its KV
caches; it reads each layer's layout from the attention backend vLLM chose
and returns the :class:`~vllm_kvreuse.device.base.DeviceOps` for this
platform. Nothing outside this folder indexes a KV cache.

- ``base.py``: the ``DeviceOps`` interface, what may be done to paged KV;
- ``layouts.py``: per-layer views of the KV caches vLLM allocates;
- ``cpu_amx.py``: the CPU attention's AMX-packed bfloat16 KV, as views;
- ``torch_ops.py``: the torch implementation, any device, the reference;
- ``triton_ops.py``: the Triton implementation, one launch per save and per
  step's loads;
- ``triton_kernels.py``: its kernels (save; loads of many pieces, with any
  rotation, and rotating neox RoPE in halves);
- ``npu.py``: chunk moves over vllm-ascend's KV cache (Ascend NPU);
- ``npu_kernels.py``: the Ascend kernels, each beside its torch equivalent;
- ``block_copy.py``: copy-on-write block copies over every KV layout;
- ``host_copy.py``: stored chunks copied to host memory off the step's
  path (a thread and a stream of their own, on CUDA).

Platform code beside them: ``cpu_cores.py``, CPU workers' OpenMP binding
with a connector of the plugin (a registered patch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vllm.logger import init_logger
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm_kvreuse.device.base import (
    ChunkLoad,
    ChunkPiece,
    DeviceOps,
    PagedKV,
    Rope,
    UnsupportedKVLayout,
)
from vllm_kvreuse.device.layouts import layer_views
from vllm_kvreuse.device.torch_ops import TorchOps

__all__ = [
    "ChunkLoad",
    "ChunkPiece",
    "DeviceOps",
    "PagedKV",
    "Rope",
    "UnsupportedKVLayout",
    "build_ops",
]

logger = init_logger(__name__)


def build_ops(
    kv_caches: Mapping[str, Any],
    forward_context: Mapping[str, Any],
    block_size: int,
    rope: Rope | None,
    layout: KVCacheLayout | None = None,
) -> DeviceOps:
    """The device ops over ``kv_caches`` (layer name -> cache, as vLLM
    registers them), in registration order.

    ``block_size`` is the KV cache manager's. ``layout`` defaults to the one
    the engine resolved, read from the current vLLM config (set while
    workers initialise their KV cache); unknown, each cache's strides must
    match a layout its backend supports.
    """
    from vllm.platforms import current_platform

    if current_platform.device_type == "npu":  # vllm-ascend's platform
        from vllm_kvreuse.device.npu import build_ascend_ops

        return build_ascend_ops(kv_caches, block_size, rope)

    layout = layout or resolved_layout()
    modules = [forward_context[name] for name in kv_caches]
    layers = [
        layer_views(module, cache, block_size, layout)
        for module, cache in zip(modules, kv_caches.values(), strict=True)
    ]
    ops = ops_class(layers)(layers, rope, block_size=block_size)
    logger.info(
        "chunk cache: %s ops over %d layers of %s (layout %s, %d-token blocks)",
        ops.name,
        len(layers),
        modules[0].attn_backend.get_name(),
        layout.name if layout else "inferred from strides",
        ops.kernel_block_size,
    )
    return ops


def ops_class(layers: Sequence[PagedKV]) -> type[DeviceOps]:
    """TritonOps on CUDA when Triton imports and can address the layers;
    TorchOps elsewhere (CPU keeps torch: the interpreter is for tests)."""
    if layers[0].keys.device.type != "cuda":
        return TorchOps
    try:
        from vllm_kvreuse.device.triton_ops import TritonOps, unsupported_reason
    except ImportError as error:
        logger.warning("chunk cache: Triton unavailable (%s); torch ops", error)
        return TorchOps
    if reason := unsupported_reason(layers):
        logger.warning("chunk cache: %s; torch ops", reason)
        return TorchOps
    return TritonOps


def resolved_layout() -> KVCacheLayout | None:
    """The engine's KV cache layout, if this process knows it yet."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None or config.cache_config.kv_cache_layout is None:
        return None
    return config.cache_config.get_resolved_kv_cache_layout()
