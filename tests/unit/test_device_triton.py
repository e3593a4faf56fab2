"""The fused Triton chunk ops against the torch reference, in Triton's
interpreter on CPU, over every layout vLLM can allocate.

The interpreter executes the kernel's indexing and float32 arithmetic on
CPU tensors as the GPU would run them (up to fused multiply-add rounding),
so any difference from :class:`TorchOps` is a bug in the kernel or in how
its arguments are derived. Shapes stay tiny: each launch runs in Python.
"""

from __future__ import annotations

import pytest
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.v1.kv_cache_interface import KVCacheLayout

from vllm_kvreuse.device import ChunkLoad, ChunkPiece, PagedKV, Rope
from vllm_kvreuse.device.layouts import content_packed_views, cpu_attn_views
from vllm_kvreuse.device.torch_ops import TorchOps
from vllm_kvreuse.testing.kv_caches import KVShape, allocate

pytest.importorskip("triton")
pytest.importorskip("triton.runtime.interpreter")

from vllm_kvreuse.device.triton_ops import TritonOps

HEADS, HEAD_SIZE, BLOCK = 2, 32, 16
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def make_rope(rotary_dim: int = HEAD_SIZE, neox: bool = True) -> Rope:
    with set_current_vllm_config(VllmConfig()):
        embedding = RotaryEmbedding(
            HEAD_SIZE, rotary_dim, 4096, 10000.0, neox, dtype=torch.float32
        )
    return Rope(embedding.cos_sin_cache, HEAD_SIZE, rotary_dim, neox)


def content_packed(
    layout: KVCacheLayout,
    dtype: torch.dtype,
    kernel_block_size: int | None = None,
    device: str = "cpu",
) -> list[PagedKV]:
    """Three layers' views of caches from vLLM's allocator, filled with noise
    so that writes to the wrong slot show."""
    shape = KVShape(num_layers=3, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=dtype)
    caches = allocate(shape, 6, 2 * BLOCK if kernel_block_size else BLOCK, layout,
                      device, kernel_block_size)  # fmt: skip
    for cache in caches.values():
        cache.copy_(torch.randn(cache.shape))
    return [content_packed_views(cache, HEAD_SIZE) for cache in caches.values()]


def twins(layers: list[PagedKV], rope: Rope | None, **kwargs) -> tuple:
    """TorchOps over ``layers`` and TritonOps over identical copies of their
    buffers (views with the same strides and offsets)."""
    copies: dict[int, torch.Tensor] = {}

    def moved(view: torch.Tensor) -> torch.Tensor:
        storage = view.untyped_storage()
        if storage.data_ptr() not in copies:
            flat = torch.empty(0, dtype=view.dtype, device=view.device)
            flat.set_(storage)
            copies[storage.data_ptr()] = flat.clone()
        return copies[storage.data_ptr()].as_strided(
            view.shape, view.stride(), view.storage_offset()
        )

    copied = [PagedKV(moved(kv.keys), moved(kv.values)) for kv in layers]
    return TorchOps(layers, rope, **kwargs), TritonOps(copied, rope, **kwargs)


def assert_same_caches(reference: TorchOps, fused: TritonOps) -> None:
    """Values are copied bit for bit. Keys are rotated in float32 on both
    paths with the same operations, so they agree exactly, except that
    Triton's interpreter truncates float32 to bfloat16 where torch (and the
    GPU's default conversion) rounds to nearest: one bfloat16 ulp at most."""
    pairs = zip(reference.layers, fused.layers, strict=True)
    for layer, (want, got) in enumerate(pairs):
        assert got.keys.data_ptr() != want.keys.data_ptr()
        assert torch.equal(got.values, want.values), f"layer {layer} values"
        if want.keys.dtype == torch.bfloat16:
            torch.testing.assert_close(got.keys, want.keys, rtol=2**-7, atol=0)
        else:
            assert torch.equal(got.keys, want.keys), f"layer {layer} keys"


def exercise(reference: TorchOps, fused: TritonOps, delta: int) -> None:
    """Save a window, load a stored chunk at an unaligned position with a
    delta, and compare both ops' saved chunks and whole caches."""
    dtype = reference.layers[0].keys.dtype
    table = torch.tensor([5, 2, 0, 4], device=reference.device)
    saved = reference.save_chunk(table, 3, 37)
    assert torch.equal(fused.save_chunk(table, 3, 37), saved)
    stored = torch.randn(3, 2, 50, HEADS, HEAD_SIZE).to(dtype)
    for ops in (reference, fused):
        ops.load_chunk(table, 7, stored, 4, 41, delta)
    assert_same_caches(reference, fused)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=str)
def test_fused_ops_match_torch_on_every_layout(layout, dtype, device) -> None:
    """Neox RoPE over the whole head, every layout vLLM can allocate; on CPU
    in the interpreter, on a GPU compiled."""
    for delta in (1000, -700):  # -700: computed after a long fill context
        layers = content_packed(layout, dtype, device=device)
        reference, fused = twins(layers, make_rope())
        exercise(reference, fused, delta=delta)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("rotary_dim", "neox"), [(HEAD_SIZE, False), (HEAD_SIZE // 2, True), (8, False)]
)
def test_fused_rotation_matches_torch_for_gptj_and_partial_rotary(
    rotary_dim: int, neox: bool, dtype
) -> None:
    layers = content_packed(KVCacheLayout.LBHNC, dtype)
    reference, fused = twins(layers, make_rope(rotary_dim, neox))
    exercise(reference, fused, delta=2049)


def test_fused_ops_address_the_cpu_layout_and_split_kernel_blocks() -> None:
    """Keys stored transposed (CPU_ATTN) and 2 kernel blocks per manager
    block go through the same kernel."""
    caches = [torch.randn(6, HEADS, BLOCK, 2 * HEAD_SIZE) for _ in range(3)]
    reference, fused = twins([cpu_attn_views(c, BLOCK, "vec") for c in caches],
                             make_rope())  # fmt: skip
    exercise(reference, fused, delta=5)
    layers = content_packed(KVCacheLayout.LBNHC, torch.bfloat16, kernel_block_size=16)
    reference, fused = twins(layers, make_rope(), block_size=2 * BLOCK)
    assert fused.kernel_blocks_per_block == 2
    exercise(reference, fused, delta=0)


def test_fused_ops_address_separately_allocated_layers() -> None:
    """Layers in unrelated allocations are reached by their address offsets."""
    layers = [
        content_packed_views(
            torch.randn(6, HEADS, BLOCK, 2 * HEAD_SIZE).to(torch.float16), HEAD_SIZE
        )
        for _ in range(3)
    ]
    rope = make_rope()
    fused_layers = [PagedKV(kv.keys.clone(), kv.values.clone()) for kv in layers]
    reference, fused = TorchOps(layers, rope), TritonOps(fused_layers, rope)
    exercise(reference, fused, delta=300)


def test_a_chunk_past_the_block_table_is_refused_before_any_write() -> None:
    _, fused = twins(content_packed(KVCacheLayout.LBNHC, torch.float32), None)
    before = [kv.keys.clone() for kv in fused.layers]
    with pytest.raises(AssertionError, match="past the request's block table"):
        fused.load_chunk(torch.tensor([1]), 10, torch.zeros(3, 2, 8, 2, 32), 0, 8, 0)
    after = [kv.keys for kv in fused.layers]
    assert all(map(torch.equal, before, after)), "a refused load wrote to the cache"


def compiled_accesses(name: str, constants: dict[str, int]) -> list[str]:
    """The global loads and stores of kernel ``name`` compiled offline for
    sm_90 (no GPU needed), with what the JIT infers from real arguments:
    16-byte aligned pointers and strides that are multiples of 16 (what
    varies per launch is not specialised)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vllm_kvreuse.device.triton_kernels import UNSPECIALISED, kernel_for

    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("Triton was built without its NVIDIA backend")
    kernel = kernel_for("cuda", name)
    # A launch relies on the JIT's own reading of the constexpr annotations
    # (this signature names them itself): a kernel that had lost them
    # compiled here, ran in the interpreter, and failed on an H100.
    declared = {param.name for param in kernel.params if param.is_constexpr}
    assert declared == set(constants) - {"c_dim", "k_dim", "v_dim"}
    pointers = {"chunk_ptr": "*bf16", "cache_ptr": "*bf16", "offsets_ptr": "*i64",
                "block_ids_ptr": "*i64", "cos_sin_ptr": "*fp32",
                "pieces_ptr": "*i64"}  # fmt: skip
    signature = {
        arg: pointers.get(arg, "constexpr" if arg in constants else "i32")
        for arg in kernel.arg_names
    }
    aligned = set(kernel.arg_names) - set(constants) - set(UNSPECIALISED[name])
    attrs = {(kernel.arg_names.index(arg),): [["tt.divisibility", 16]]
             for arg in aligned}  # fmt: skip
    compiled = triton.compile(
        ASTSource(kernel, signature, constants, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": TritonOps.NUM_WARPS, "enable_fp_fusion": False},
    )
    return re.findall(r"(?:ld|st)\.global\.[\w.]+", compiled.asm["ptx"])


@pytest.mark.parametrize("name", ["load", "save"])
def test_kernel_compiles_to_16_byte_accesses_for_hopper(name: str) -> None:
    """At Llama-8B's KV shape, the save and the rotating load (element-wise
    rotation) move the cache and the chunk with 16-byte vector instructions:
    the bandwidth target needs them, and losing an alignment hint silently
    turns them into 2-byte ones. Only the rotation's partner reads (L1 hits
    of lines just read) stay scalar; the load's 8-byte reads are its piece
    table, block ids and layer offsets."""
    constants = dict(NUM_HEADS=8, HEAD_SIZE=128, BLOCK_T=4, BLOCK_HD=1024,
                     ALIGN=16, k_dim=1, v_dim=1)  # fmt: skip
    if name == "save":
        constants["c_dim"] = 1
    else:
        constants |= dict(ROTARY_DIM=128, IS_NEOX=True, ROTATE=True,
                          MAX_PIECES=64, CHUNK_ALIGN=16)  # fmt: skip
    accesses = compiled_accesses(name, constants)
    stores = [a for a in accesses if a.startswith("st.")]
    assert stores and set(stores) == {"st.global.v4.b32"}, sorted(set(stores))
    vector_loads = accesses.count("ld.global.v4.b32")
    assert vector_loads >= 8, f"K and V read in {vector_loads} vector loads"
    scalar_loads = accesses.count("ld.global.b16")
    assert scalar_loads == (0 if name == "save" else 32), "only partner reads"


def compiled_variants() -> int:
    """How many variants of the CUDA kernels Triton has compiled so far."""
    from vllm_kvreuse.device.triton_kernels import KERNELS, kernel_for

    kernels = [kernel_for("cuda", name) for name in KERNELS]
    caches = [getattr(kernel, "device_caches", None) for kernel in kernels]
    if None in caches:
        pytest.skip("this Triton keeps its compiled kernels elsewhere")
    return sum(len(entry[0]) for cache in caches for entry in cache.values())


@CUDA
def test_warm_up_compiles_every_variant_a_request_launches() -> None:
    """After the ops' warm-up (run when the worker builds them), saves and
    loads of any length, position, delta and number of pieces compile
    nothing: a request never waits for Triton's compiler."""
    layers = content_packed(KVCacheLayout.LBNHC, torch.bfloat16, device="cuda")
    ops = TritonOps(layers, make_rope())
    ops.warm_up()
    compiled = compiled_variants()
    table = torch.tensor([5, 2, 0, 4], device="cuda")
    stored = torch.randn(3, 2, 50, HEADS, HEAD_SIZE, dtype=torch.bfloat16)
    for count in (1, 17, 37, 61):
        ops.save_chunk(table, 3, count)
        for delta in (0, 5, -3, 1000):
            ops.load_chunk(table, 7, stored, 4, min(count, 41), delta)
            ops.load_chunk(table, 0, stored.cuda(), 0, count // 2 + 1, delta)
            pieces = [
                ChunkPiece(stored, 0, 0, 16, delta),
                ChunkPiece(stored.cuda(), 3, 20, count // 4 + 1, 0),
            ]
            other = torch.tensor([1, 3], device="cuda")  # another request's
            ops.load_chunks([ChunkLoad(table.cpu(), pieces),
                             ChunkLoad(other, pieces[:1])])  # fmt: skip
    torch.cuda.synchronize()
    assert compiled_variants() == compiled


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_halves_kernel_moves_the_bits_the_general_one_moves(dtype) -> None:
    """Neox RoPE over the whole head loads through halves_kernel: the same
    arithmetic as load_kernel's element-wise rotation, so the same bits."""
    layers = content_packed(KVCacheLayout.LBNHC, dtype)
    _, halves = twins(layers, make_rope())
    _, general = twins(layers, make_rope())
    general.HALVES = False
    table = torch.tensor([5, 2, 0, 4])
    stored = torch.randn(3, 2, 50, HEADS, HEAD_SIZE).to(dtype)
    for delta in (7, -3):
        for ops in (halves, general):
            ops.load_chunk(table, 7, stored, 4, 41, delta)
        for a, b in zip(halves.layers, general.layers, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_the_halves_kernel_reads_and_writes_in_16_byte_vectors() -> None:
    """At Qwen2-0.5B's KV shape (2 heads of 64), where the element-wise
    partner reads made the rotating load half as fast as an unmoved one on
    an H200: every access to the chunk and the cache is a 16-byte vector."""
    constants = dict(NUM_HEADS=2, HALF=32, BLOCK_T=32, BLOCK_P=64, MAX_PIECES=64,
                     ALIGN=16, CHUNK_ALIGN=16, k_dim=1, v_dim=1)  # fmt: skip
    accesses = set(compiled_accesses("halves", constants))
    # b64: the piece table, block ids and layer offsets
    assert accesses == {"ld.global.v4.b32", "st.global.v4.b32", "ld.global.b64"}
