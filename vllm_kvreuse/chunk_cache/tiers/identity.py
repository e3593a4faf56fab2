"""What a store's bytes belong to: the model identity in every chunk key,
the fingerprint of stored bytes, and the store key.

Both sides read these: the engine core keys chunks and looks the store up,
each worker writes and reads the bytes.
"""

from __future__ import annotations

import hashlib
from typing import Any

from vllm_kvreuse.chunk_cache.tiers.codec import fingerprint


def model_identity(vllm_config: Any) -> tuple[str, ...]:
    """What besides tokens a chunk's KV depends on, for every key."""
    model = vllm_config.model_config
    return (
        str(model.model),
        str(model.revision or ""),
        str(vllm_config.cache_config.cache_dtype),
        str(model.dtype),
        "in-place",  # how stored chunks are computed (keys of other schemes differ)
    )


STORE_FORMAT = "chunks-2"
"""Changes when stored chunk bytes mean something else."""
WEIGHT_SAMPLES = 8
"""Slices of each weight file read into the fingerprint (64 KiB each)."""


def store_fingerprint(vllm_config: Any) -> str:
    """What stored chunk bytes on disk or in the shared store depend on
    beyond their key: the model identity (with its KV dtype), its weights,
    quantization, config overrides and RoPE scaling, the key hash, the block
    size, the parallel layout (each rank stores its own heads or layers),
    the platform and the format. Servers with one fingerprint can read each
    other's chunks; any other is another directory or namespace."""
    from vllm.platforms import current_platform

    parallel = vllm_config.parallel_config
    model = vllm_config.model_config
    hf_config = getattr(model, "hf_config", None)
    return fingerprint(
        (
            *model_identity(vllm_config),
            str(getattr(model, "quantization", None)),
            repr(getattr(model, "hf_overrides", None)),
            repr(getattr(hf_config, "rope_scaling", None)),
            repr(getattr(hf_config, "rope_parameters", None)),
            weights_digest(str(model.model)),
            vllm_config.cache_config.prefix_caching_hash_algo,
            vllm_config.cache_config.block_size,
            parallel.tensor_parallel_size,
            parallel.pipeline_parallel_size,
            current_platform.device_type,
            STORE_FORMAT,
        )
    )


def weights_digest(model: str) -> str:
    """A digest of a local model directory's weight files (names, sizes,
    and :data:`WEIGHT_SAMPLES` slices of each: fine-tuned weights of one
    shape differ there), cheap at any size; ``""`` for a hub name (its
    revision is in :func:`model_identity`)."""
    import os

    if not os.path.isdir(model):
        return ""
    digest = hashlib.sha256()
    names = sorted(
        name for name in os.listdir(model)
        if name.endswith((".safetensors", ".bin", ".pt", ".gguf"))
    )  # fmt: skip
    for name in names:
        path = os.path.join(model, name)
        size = os.path.getsize(path)
        digest.update(f"{name}:{size}".encode())
        with open(path, "rb") as file:
            for number in range(WEIGHT_SAMPLES):
                file.seek(size * number // WEIGHT_SAMPLES)
                digest.update(file.read(1 << 16))
    return digest.hexdigest()


def store_secret(settings: Any) -> bytes | None:
    """The store key of ``--chunk-cache-store-key-file`` (None: unset)."""
    path = settings.chunk_cache_store_key_file
    if not path:
        return None
    with open(path, "rb") as file:
        return file.read().strip()
