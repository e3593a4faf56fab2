"""Copy-on-write block copies over every KV layout vLLM's runners hold.

vLLM 0.32 applies ``SchedulerOutput.kv_cache_block_copies`` (a child's or a
beam's private copy of a shared partial block) with
``vllm.v1.worker.utils.copy_kv_cache_blocks_inplace``, which takes one tensor
per layer, block-major. vllm-ascend's runner holds each layer as a tuple of
tensors (``(k_cache, v_cache)``, each ``[num_blocks, block_size, H, D]``),
which that helper cannot address. Each member of the tuple is itself a
block-major tensor, so handing the helper the members is a complete copy.

On CPU the helper's batched ``blocks[dst] = blocks[src]`` runs torch's
element-wise ``index_put_``: measured here, 128 copies of 32 KiB blocks took
30-75 ms, against 0.5 ms for one ``copy_`` (a memcpy) per block. A beam step
copies one tail block per beam, so on CPU tensors whose dim 0 counts blocks
(every CPU attention layout) the copies are done block by block; anything
else goes to vLLM's helper.
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
        tensors = layer_tensors(kv_caches)
        if kv_cache_block_copies:
            tensors = copy_cpu_blocks(tensors, num_blocks, kv_cache_block_copies)
        if tensors:
            original(tensors, num_blocks, kv_cache_block_copies)

    return copy_kv_cache_blocks_inplace


def copy_cpu_blocks(
    tensors: list[torch.Tensor], num_blocks: int, copies: Sequence[Any]
) -> list[torch.Tensor]:
    """Applies ``copies`` (``(src, dst)`` scheduler block ids) to every CPU
    tensor whose dim 0 counts blocks (``num_blocks`` times the kernel blocks
    per block), one ``copy_`` per block; returns the tensors left undone.

    The result equals the helper's: destinations are fresh copy-on-write
    blocks, never a source of the same batch (checked; otherwise everything
    goes to the helper, which reads every source before writing). Tensors
    aliasing one another (cross-layer KV sharing) are copied once.
    """
    pairs = [(int(src), int(dst)) for src, dst in copies]
    if {dst for _, dst in pairs} & {src for src, _ in pairs}:
        return tensors
    rest: list[torch.Tensor] = []
    seen: set[int] = set()
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.shape[0] % num_blocks:
            rest.append(tensor)
            continue
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        blocks = tensor.unflatten(0, (num_blocks, tensor.shape[0] // num_blocks))
        for src, dst in pairs:
            blocks[dst].copy_(blocks[src])
    return rest


def copy_blocks_indexed(
    kv_caches: Iterable[Any], num_blocks: int, src: torch.Tensor, dst: torch.Tensor
) -> None:
    """Copies block ``src[i]`` to ``dst[i]`` (scheduler block ids, tensors on
    the caches' device) in every layer: a beam moved onto another beam's
    member takes its parent's private KV (:mod:`vllm_kvreuse.beam.worker.job`).

    Every source is read before any destination is written (a gather, then a
    scatter); no host sync on an accelerator, so destinations may repeat
    when they repeat their source's value (a block copied onto itself). On
    CPU, one ``copy_`` per block that moves (see :func:`copy_cpu_blocks`;
    reading the ids costs nothing there): a block copied onto itself is
    left out, and no destination is another pair's source (the caller's
    invariant: a destination member carried a beam without children).
    """
    if not len(src):
        return
    seen: set[int] = set()
    pairs: list[tuple[int, int]] | None = None
    for tensor in layer_tensors(kv_caches):
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        per_block, remainder = divmod(tensor.shape[0], num_blocks)
        assert remainder == 0, (
            f"{tensor.shape[0]} kernel blocks not divisible by {num_blocks} blocks"
        )
        blocks = tensor.unflatten(0, (num_blocks, per_block))
        if tensor.device.type == "cpu":
            if pairs is None:
                moves = zip(src.tolist(), dst.tolist(), strict=True)
                pairs = [(s, d) for s, d in moves if s != d]
            for s, d in pairs:
                blocks[d].copy_(blocks[s])
        else:
            blocks[dst] = blocks[src.to(tensor.device)]
