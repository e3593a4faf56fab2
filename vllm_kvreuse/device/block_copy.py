"""Copy-on-write block copies over every KV layout vLLM's runners hold.

vLLM 0.32 applies ``SchedulerOutput.kv_cache_block_copies`` (a child's or a
beam's private copy of a shared partial block) with
``vllm.v1.worker.utils.copy_kv_cache_blocks_inplace``, which takes one tensor
per layer, block-major. vllm-ascend's runner holds each layer as a tuple of
tensors (``(k_cache, v_cache)``, each ``[num_blocks, block_size, H, D]``),
which that helper cannot address. Each member of the tuple is itself a
block-major tensor, so handing the helper the members is a complete copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch


def layer_tensors(kv_caches: Iterable[Any]) -> list[torch.Tensor]:
    """Every cache tensor of ``kv_caches``, in order: a tensor as itself, a
    tuple or list (vllm-ascend's ``(k, v)``) as its members.

    Each returned tensor has the block on dim 0, as vLLM's helper requires.
    """
    tensors: list[torch.Tensor] = []
    for cache in kv_caches:
        members = [cache] if isinstance(cache, torch.Tensor) else list(cache)
        for member in members:
            assert isinstance(member, torch.Tensor), (
                f"a layer's KV cache holds a {type(member).__name__}; the block "
                "copy knows tensors and tuples of tensors only"
            )
        tensors.extend(members)
    return tensors


def wrap_copy_kv_cache_blocks(
    original: Callable[..., None],
) -> Callable[..., None]:
    """``copy_kv_cache_blocks_inplace`` that also takes tuples of tensors.

    Mutates the destination blocks of every tensor, as the original does;
    for a list of plain tensors the call is the original's, unchanged.
    """

    def copy_kv_cache_blocks_inplace(
        kv_caches: Iterable[Any],
        num_blocks: int,
        kv_cache_block_copies: Sequence[Any],
    ) -> None:
        original(layer_tensors(kv_caches), num_blocks, kv_cache_block_copies)

    return copy_kv_cache_blocks_inplace
