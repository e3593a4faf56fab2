"""Copy-on-write block copies on vllm-ascend's ``(k, v)`` layout.

vLLM 0.32's model runner applies ``SchedulerOutput.kv_cache_block_copies``
with ``copy_kv_cache_blocks_inplace``; these tests call vLLM's real helper
(unpatched, then as the runner sees it with the plugin loaded) on caches
built as vllm-ascend builds them, on CPU.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

from vllm_kvreuse.device.block_copy import copy_blocks_indexed, copy_cpu_blocks
from vllm_kvreuse.patches import PATCHES, apply_for_runner
from vllm_kvreuse.testing.ascend_layout import ascend_layer

NUM_BLOCKS = 5
COPIES = [KVCacheBlockCopy(1, 3), KVCacheBlockCopy(4, 0)]
COPY_TARGETS = [
    p for p in PATCHES if p.target.endswith(":copy_kv_cache_blocks_inplace")
]


def filled(layers: list) -> list:
    """Every tensor of ``layers`` filled with random values, in place."""
    for layer in layers:
        for tensor in layer if isinstance(layer, tuple) else (layer,):
            tensor.copy_(torch.randn(tensor.shape).to(tensor.dtype))
    return layers


def assert_copied(before: torch.Tensor, after: torch.Tensor, splits: int) -> None:
    """``after`` is ``before`` with each copy's destination scheduler block
    (``splits`` kernel blocks) replaced by its source block."""
    expected = before.clone().unflatten(0, (NUM_BLOCKS, splits))
    for copy in COPIES:
        expected[copy.dst_block_id] = expected[copy.src_block_id]
    assert torch.equal(after, expected.flatten(0, 1))


def test_vllms_helper_alone_fails_on_vllm_ascend_tuples() -> None:
    """Why the patch exists: the upstream helper reads ``.device`` of a tuple."""
    upstream = COPY_TARGETS[0].original()
    layers = [ascend_layer(NUM_BLOCKS, 2, 16, torch.bfloat16, block_size=16)]
    with pytest.raises(AttributeError, match="device"):
        upstream(layers, NUM_BLOCKS, COPIES)


@pytest.mark.parametrize("with_connector", [True, False])
@pytest.mark.parametrize("kernel_block_size", [None, 8])
@pytest.mark.parametrize("patch", COPY_TARGETS, ids=lambda p: p.runner)
def test_the_runners_block_copy_handles_vllm_ascend_tuples(
    patch, kernel_block_size: int | None, with_connector: bool
) -> None:
    """Each binding vLLM's runners call copies both members of every layer's
    tuple: with a 2 MiB-aligned slice of a larger buffer (a KV connector is
    set) or a buffer of its own, and with split kernel blocks. Layers that
    share a cache (cross-layer sharing) are copied once."""
    apply_for_runner(patch.runner)  # as a worker that builds this runner does
    module = patch.target.split(":")[0]
    copy = importlib.import_module(module).copy_kv_cache_blocks_inplace
    layers = filled(
        [
            ascend_layer(
                NUM_BLOCKS, 2, 16, torch.bfloat16, block_size=16,
                kernel_block_size=kernel_block_size, with_connector=with_connector,
            )
            for _ in range(3)
        ]
    )  # fmt: skip
    layers.append(layers[0])  # a layer reusing layer 0's KV
    before = [tensor.clone() for layer in layers[:3] for tensor in layer]
    copy(layers, NUM_BLOCKS, COPIES)
    after = [tensor for layer in layers[:3] for tensor in layer]
    splits = 16 // (kernel_block_size or 16)
    for old, new in zip(before, after, strict=True):
        assert_copied(old, new, splits)


def test_plain_tensors_are_copied() -> None:
    """vLLM's own layouts (here CPU attention's ``[blocks, H, block, 2D]``)."""
    copy = importlib.import_module(
        "vllm.v1.worker.gpu_model_runner"
    ).copy_kv_cache_blocks_inplace
    layers = filled([torch.zeros(NUM_BLOCKS, 2, 16, 64) for _ in range(2)])
    before = [layer.clone() for layer in layers]
    copy(iter(layers), NUM_BLOCKS, COPIES)  # the runners pass any iterable
    for old, new in zip(before, layers, strict=True):
        assert_copied(old, new, 1)


@pytest.mark.parametrize("kernel_splits", [1, 2])
def test_cpu_block_copies_equal_vllms_helper(kernel_splits: int) -> None:
    """On CPU the copies run block by block (vLLM's batched index_put is
    element-wise there); the caches end exactly as vLLM's helper leaves them,
    a layer aliasing another included. A batch whose destination is also a
    source goes to vLLM's helper, whose reads all precede its writes."""
    upstream = COPY_TARGETS[0].original()
    apply_for_runner("v1")  # as a V1 worker does
    patched = importlib.import_module(
        "vllm.v1.worker.gpu_model_runner"
    ).copy_kv_cache_blocks_inplace
    shape = (NUM_BLOCKS * kernel_splits, 2, 16 // kernel_splits, 64)
    for copies in (COPIES, [KVCacheBlockCopy(1, 3), KVCacheBlockCopy(3, 2)]):
        ours = filled([torch.zeros(shape) for _ in range(2)])
        ours.append(ours[0])
        theirs = [layer.clone() for layer in ours[:2]]
        patched(ours, NUM_BLOCKS, copies)
        upstream(theirs, NUM_BLOCKS, copies)
        for mine, reference in zip(ours[:2], theirs, strict=True):
            assert torch.equal(mine, reference)
    layers = [torch.zeros(shape)]
    assert copy_cpu_blocks(layers, NUM_BLOCKS, COPIES) == []  # done block by block
    chained = [KVCacheBlockCopy(1, 3), KVCacheBlockCopy(3, 2)]
    assert copy_cpu_blocks(layers, NUM_BLOCKS, chained) == layers  # to the helper


@pytest.mark.parametrize("kernel_splits", [1, 2])
def test_indexed_block_copies_equal_vllms_helper(kernel_splits: int) -> None:
    """A moved beam's private blocks, copied by index tensors (what a worker
    holds without a host sync): the caches end as vLLM's helper leaves them
    for the same pairs, tuples of vllm-ascend's layout and aliased layers
    included; on an accelerator a pair may repeat its own block (a no-op)."""
    upstream = COPY_TARGETS[0].original()
    shape = (NUM_BLOCKS * kernel_splits, 2, 16 // kernel_splits, 64)
    ours = filled([torch.zeros(shape) for _ in range(2)])
    ours.append(ours[0])
    theirs = [layer.clone() for layer in ours[:2]]
    src, dst = torch.tensor([1, 4]), torch.tensor([3, 0])
    copy_blocks_indexed(ours, NUM_BLOCKS, src, dst)
    upstream(theirs, NUM_BLOCKS, COPIES)
    for mine, reference in zip(ours[:2], theirs, strict=True):
        assert torch.equal(mine, reference)
    tuples = filled([ascend_layer(NUM_BLOCKS, 2, 16, torch.bfloat16, block_size=16)])
    before = [tensor.clone() for tensor in tuples[0]]
    copy_blocks_indexed(tuples, NUM_BLOCKS, src, dst)
    for old, new in zip(before, tuples[0], strict=True):
        assert_copied(old, new, 1)
    copy_blocks_indexed(ours, NUM_BLOCKS, src[:0], dst[:0])  # nothing moved
