"""Per-layer KV caches built by vLLM's own allocator, on any device.

Tests and benchmarks need the exact tensors a KV connector receives on a GPU
worker without a GPU. vLLM's allocation runs anywhere torch does: the KV
cache config comes from ``get_kv_cache_config_from_groups`` (the engine's
layer and block strides for a layout) and the tensors from
``allocate_kv_cache`` (what both GPU model runners register with a
connector). Only the attention modules differ from a real worker: they are
built here with a chosen backend instead of vLLM's platform selection.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.v1.attention.backends.utils import record_kv_cache_layout
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
)
from vllm.v1.worker.utils import allocate_kv_cache

BACKEND_CLASSES = {
    "FLASH_ATTN": "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend",
    "TRITON_ATTN": "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend",
    "FLEX_ATTENTION": (
        "vllm.v1.attention.backends.flex_attention.FlexAttentionBackend"
    ),
    "FLASHINFER": "vllm.v1.attention.backends.flashinfer.FlashInferBackend",
    "CPU_ATTN": "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend",
}


@dataclass(frozen=True, slots=True)
class KVShape:
    """The KV geometry of a model, per worker."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype


def backend_class(name: str) -> type:
    """vLLM's backend class by registry name (ImportError if not installed)."""
    import importlib

    module, _, cls = BACKEND_CLASSES[name].rpartition(".")
    return getattr(importlib.import_module(module), cls)


def layer_names(num_layers: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]


def kv_cache_config(
    shape: KVShape, num_blocks: int, block_size: int, layout: KVCacheLayout
) -> KVCacheConfig:
    """The engine's KV cache config: one group, ``num_blocks`` blocks."""
    vllm_config = VllmConfig(cache_config=CacheConfig(block_size=block_size))
    record_kv_cache_layout(vllm_config.cache_config, layout.name)
    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=shape.num_kv_heads,
        head_size=shape.head_size,
        dtype=shape.dtype,
    )
    groups = [KVCacheGroupSpec(layer_names(shape.num_layers), spec)]
    memory = spec.page_size_bytes * shape.num_layers * num_blocks
    config = get_kv_cache_config_from_groups(vllm_config, groups, memory)
    assert config.num_blocks == num_blocks, "vLLM sized the pool differently"
    return config


def allocate(
    shape: KVShape,
    num_blocks: int,
    block_size: int,
    layout: KVCacheLayout,
    device: torch.device | str = "cpu",
    kernel_block_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """Layer name -> cache, exactly as a worker registers them with a KV
    connector (zeroed, one shared buffer)."""
    config = kv_cache_config(shape, num_blocks, block_size, layout)
    kernel = [kernel_block_size] if kernel_block_size else None
    return allocate_kv_cache(config, torch.device(device), layout, kernel)


@contextlib.contextmanager
def attention_layers(
    backend: str,
    shape: KVShape,
    block_size: int,
    model_dir: str | None = None,
    kv_cache_dtype: str = "auto",
) -> Iterator[dict[str, torch.nn.Module]]:
    """vLLM ``Attention`` modules on ``backend`` (layer name -> module), as
    the static forward context holds them, under their vLLM config.

    ``model_dir`` gives the model config that CPU_ATTN needs and that sets
    the KV dtype of ``auto``; without it vLLM's default is float16.
    """
    from vllm.model_executor.layers.attention import Attention

    model = None
    if model_dir is not None:
        model = ModelConfig(
            model_dir, dtype=shape.dtype, max_model_len=1024, skip_tokenizer_init=True
        )
    cache = CacheConfig(block_size=block_size, cache_dtype=kv_cache_dtype)
    vllm_config = VllmConfig(model_config=model, cache_config=cache)
    backend_cls = backend_class(backend)
    default_dtype = torch.get_default_dtype()
    with set_current_vllm_config(vllm_config):
        try:
            torch.set_default_dtype(shape.dtype)
            layers = {
                name: Attention(
                    num_heads=shape.num_kv_heads,
                    head_size=shape.head_size,
                    scale=shape.head_size**-0.5,
                    num_kv_heads=shape.num_kv_heads,
                    cache_config=cache,
                    prefix=name,
                    attn_backend=backend_cls,
                )
                for name in layer_names(shape.num_layers)
            }
        finally:
            torch.set_default_dtype(default_dtype)
        yield layers
