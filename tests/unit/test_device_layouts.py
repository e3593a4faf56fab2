"""Layer views of the KV caches vLLM allocates for each CUDA backend, on CPU.

The caches come from vLLM's own allocator (``allocate_kv_cache`` over the
engine's ``get_kv_cache_config_from_groups``) and the attention modules are
vLLM's, on the named backend. No CUDA backend's cache writer runs on CPU
(``reshape_and_cache_flash`` is a CUDA op; the Triton one asks for the CUDA
capability), so the views are checked against memory offsets computed
independently from the layout descriptor: logical ``[L, B, H, N, C]``,
``C`` = keys then values, laid out row-major in ``stride_order``.
"""

from __future__ import annotations

import math

import pytest
import torch
from vllm.v1.kv_cache_interface import KVCacheLayout

from vllm_kvreuse.device import UnsupportedKVLayout, build_ops
from vllm_kvreuse.device.layouts import layer_views, matching_layouts
from vllm_kvreuse.device.torch_ops import TorchOps, read_tokens, slots_of, write_tokens
from vllm_kvreuse.testing.kv_caches import KVShape, allocate, attention_layers

ALL_LAYOUTS = list(KVCacheLayout)
HALF = [torch.float16, torch.bfloat16]
CASES = [
    # FLASH_ATTN and TRITON_ATTN declare no layout: the engine's default is
    # LBNHC and VLLM_KV_CACHE_LAYOUT may pick any other.
    *[("FLASH_ATTN", lay, dt) for lay in ALL_LAYOUTS for dt in HALF],
    *[("TRITON_ATTN", lay, dt) for lay in ALL_LAYOUTS for dt in [*HALF, torch.float32]],
    *[("FLEX_ATTENTION", KVCacheLayout.LBNHC, dt) for dt in [*HALF, torch.float32]],
    # FlashInfer: any layout before Blackwell (LBNHC by default), LBHNC or
    # BLHNC on Blackwell (supported_kv_cache_layouts, flashinfer.py:604).
    *[
        ("FLASHINFER", lay, dt)
        for lay in (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.BLHNC)
        for dt in HALF
    ],
]  # fmt: skip
BLOCK = 16


def descriptor_offsets(
    layout: KVCacheLayout, num_layers: int, views_shape: tuple[int, ...]
) -> torch.Tensor:
    """Element offsets ``[L, B, N, H, 2 * D]`` of every key and value from
    the start of the buffer: the logical axes laid out row-major in the
    layout's physical order. Written from the descriptor alone."""
    blocks, tokens, heads, head_size = views_shape
    sizes = (num_layers, blocks, heads, tokens, 2 * head_size)  # L, B, H, N, C
    strides = [0] * 5
    step = 1
    for axis in reversed(layout.stride_order):
        strides[axis] = step
        step *= sizes[axis]
    index = sum(
        torch.arange(size).view([-1 if i == axis else 1 for i in range(5)]) * stride
        for axis, (size, stride) in enumerate(zip(sizes, strides, strict=True))
    )
    return index.permute(0, 1, 3, 2, 4)  # L, B, N, H, C


def flat_storage(cache: torch.Tensor) -> torch.Tensor:
    """The whole buffer behind ``cache``, in its dtype."""
    return torch.empty(0, dtype=cache.dtype).set_(cache.untyped_storage())


def assert_views_follow_descriptor(views, caches, layout, shape) -> None:
    """Tokens written through the views land at the descriptor's offsets,
    nothing else changes, and the views read them back."""
    head_size = shape.head_size
    offsets = descriptor_offsets(layout, shape.num_layers, tuple(views[0].keys.shape))
    storage = flat_storage(next(iter(caches.values())))
    blocks, slots = slots_of(torch.tensor([4, 1, 3]), 5, 35, BLOCK)
    written = []
    for kv in views:
        keys = torch.randn(35, shape.num_kv_heads, head_size).to(shape.dtype)
        values = torch.randn(35, shape.num_kv_heads, head_size).to(shape.dtype)
        write_tokens(kv, blocks, slots, keys, values)
        written.append((keys, values))
    untouched = storage.clone()
    for layer, (keys, values) in enumerate(written):
        where = offsets[layer, blocks, slots]  # [35, H, 2D]
        stored = storage[where]
        assert torch.equal(stored[..., :head_size], keys), f"layer {layer} keys"
        assert torch.equal(stored[..., head_size:], values), f"layer {layer} values"
        untouched[where] = 0
        read_keys, read_values = read_tokens(views[layer], blocks, slots)
        assert torch.equal(read_keys, keys) and torch.equal(read_values, values)
    assert not untouched.any(), "a write landed outside the slots it names"


@pytest.mark.parametrize(("backend", "layout", "dtype"), CASES, ids=str)
def test_views_address_the_bytes_the_layout_descriptor_names(
    model_dir: str, backend: str, layout: KVCacheLayout, dtype: torch.dtype
) -> None:
    """Each backend's views, read from vLLM's objects, write the keys and
    values exactly where the resolved layout puts them."""
    shape = KVShape(num_layers=3, num_kv_heads=2, head_size=32, dtype=dtype)
    caches = allocate(shape, num_blocks=6, block_size=BLOCK, layout=layout)
    try:
        context = attention_layers(backend, shape, BLOCK, model_dir)
        layers = context.__enter__()
    except ImportError as error:
        pytest.skip(f"{backend} needs {error.name}")
    try:
        views = [
            layer_views(layers[name], cache, BLOCK, layout)
            for name, cache in caches.items()
        ]
        inferred = [layer_views(layers[n], c, BLOCK) for n, c in caches.items()]
    finally:
        context.__exit__(None, None, None)
    assert [v.keys.stride() for v in inferred] == [v.keys.stride() for v in views]
    assert_views_follow_descriptor(views, caches, layout, shape)


@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=str)
def test_strides_identify_the_layout_among_all(layout: KVCacheLayout) -> None:
    """A cache matches its own layout and every layout with the same
    per-layer order, no other."""
    shape = KVShape(num_layers=2, num_kv_heads=2, head_size=32, dtype=torch.float16)
    cache = allocate(shape, num_blocks=4, block_size=BLOCK, layout=layout)
    found = matching_layouts(next(iter(cache.values())), KVCacheLayout)
    order = layout.layer_view_order
    expected = [m for m in KVCacheLayout if m.layer_view_order == order]
    assert found == expected


def test_manager_blocks_split_into_kernel_blocks_are_addressed_by_manager_ids(
    model_dir: str,
) -> None:
    """With 32-token manager blocks and 16-token kernel blocks, manager block
    ``b`` is kernel blocks ``2b`` and ``2b + 1``."""
    shape = KVShape(num_layers=2, num_kv_heads=2, head_size=32, dtype=torch.float16)
    layout = KVCacheLayout.LBNHC
    caches = allocate(shape, 4, 32, layout, kernel_block_size=16)
    assert next(iter(caches.values())).shape[:3] == (8, 2, 16)
    with attention_layers("FLASH_ATTN", shape, 32, model_dir) as layers:
        ops = build_ops(caches, layers, 32, rope=None, layout=layout)
    assert (ops.block_size, ops.kernel_block_size) == (32, 16)
    chunk = torch.randn(2, 2, 40, 2, 32).to(shape.dtype)
    ops.load_chunk(torch.tensor([3, 0]), 10, chunk, 0, 40, delta=0)
    offsets = descriptor_offsets(layout, 2, (8, 16, 2, 32))
    storage = flat_storage(next(iter(caches.values())))
    positions = torch.arange(10, 50)
    kernel_blocks = torch.tensor([3, 0])[positions // 32] * 2 + (positions % 32) // 16
    stored = storage[offsets[:, kernel_blocks, positions % 16]]  # [L, 40, H, 2D]
    assert torch.equal(stored[..., :32], chunk[:, 0])
    assert torch.equal(stored[..., 32:], chunk[:, 1])
    assert torch.equal(ops.save_chunk(torch.tensor([3, 0]), 10, 40), chunk)


def test_build_ops_reads_the_engines_layout_and_keeps_torch_on_cpu(
    model_dir: str,
) -> None:
    """Under the worker's vLLM config the resolved layout is used; a cache
    laid out otherwise is refused rather than misread."""
    from vllm.config import get_current_vllm_config

    shape = KVShape(num_layers=2, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    caches = allocate(shape, 4, BLOCK, KVCacheLayout.LBHNC)
    with attention_layers("FLASH_ATTN", shape, BLOCK, model_dir) as layers:
        cache_config = get_current_vllm_config().cache_config
        cache_config.kv_cache_layout = "LBHNC"
        assert isinstance(build_ops(caches, layers, BLOCK, None), TorchOps)
        cache_config.kv_cache_layout = "LBNHC"
        with pytest.raises(UnsupportedKVLayout, match=r"FLASH_ATTN.*none of LBNHC"):
            build_ops(caches, layers, BLOCK, None)


@pytest.mark.parametrize(
    ("backend", "kv_cache_dtype", "layout", "match"),
    [
        ("TRITON_ATTN", "fp8", KVCacheLayout.LBNHC, "quantized.*--kv-cache-dtype auto"),
        ("CPU_ATTN", "fp8", KVCacheLayout.LBHNC, "quantized.*--kv-cache-dtype auto"),
        ("FLEX_ATTENTION", "auto", KVCacheLayout.LBHNC, "LBHNC, not one it declares"),
    ],
)  # fmt: skip
def test_caches_the_ops_cannot_address_are_refused_with_a_way_out(
    model_dir: str, backend: str, kv_cache_dtype: str, layout, match: str
) -> None:
    shape = KVShape(num_layers=1, num_kv_heads=2, head_size=32, dtype=torch.float16)
    cache = next(iter(allocate(shape, 4, BLOCK, layout).values()))
    if kv_cache_dtype != "auto":
        cache = cache.view(torch.uint8)  # vLLM stores fp8 KV as bytes
    with attention_layers(backend, shape, BLOCK, model_dir, kv_cache_dtype) as layers:
        layer = next(iter(layers.values()))
        with pytest.raises(UnsupportedKVLayout, match=match) as refused:
            layer_views(layer, cache, BLOCK, layout)
    assert backend in str(refused.value) and "--attention-backend" in str(refused.value)


def test_backends_the_ops_do_not_know_are_refused_by_name(model_dir: str) -> None:
    from vllm.v1.attention.backends.rocm_attn import RocmAttentionBackend

    shape = KVShape(num_layers=1, num_kv_heads=2, head_size=32, dtype=torch.float16)
    cache = next(iter(allocate(shape, 4, BLOCK, KVCacheLayout.LBNHC).values()))
    with attention_layers("FLASH_ATTN", shape, BLOCK, model_dir) as layers:
        layer = next(iter(layers.values()))
        layer.attn_backend = RocmAttentionBackend  # what vLLM would have picked
        with pytest.raises(UnsupportedKVLayout, match="ROCM_ATTN"):
            layer_views(layer, cache, BLOCK)


def test_descriptor_offsets_match_vllms_layout_strides() -> None:
    """The test's own offset model agrees with vLLM's stride computation,
    so a shared misreading of the descriptor would show here."""
    from vllm.v1.kv_cache_interface import compute_layout_strides

    from vllm_kvreuse.testing.kv_caches import kv_cache_config

    shape = KVShape(num_layers=3, num_kv_heads=2, head_size=32, dtype=torch.float16)
    for layout in KVCacheLayout:
        spec = kv_cache_config(shape, 5, BLOCK, layout).kv_cache_groups[0].kv_cache_spec
        strides = compute_layout_strides(spec, 5, 3, layout)  # bytes, L B H N C
        offsets = descriptor_offsets(layout, 3, (5, BLOCK, 2, 32))
        unit = [offsets[(1,) + (0,) * 4], offsets[0, 1, 0, 0, 0]]
        unit += [offsets[0, 0, 0, 1, 0], offsets[0, 0, 1, 0, 0], offsets[0, 0, 0, 0, 1]]
        # vLLM's strides are in bytes with C counted in bytes (stride 1).
        in_elements = [stride // 2 for stride in strides[:4]] + [strides[4]]
        assert [int(u) for u in unit] == in_elements, layout.name
        assert math.prod(offsets.shape) == offsets.unique().numel()
