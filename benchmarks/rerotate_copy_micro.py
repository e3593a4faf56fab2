"""Micro-benchmark: the shipped chunk ops against a plain copy of the same bytes.

Times what loading a stored chunk into a request's paged KV slots costs
(``DeviceOps.load_chunk``: keys re-rotated by a position delta, keys and
values scattered into the cache) and saving one (``save_chunk``: gathered
out of the cache), next to ``dst.copy_(src)`` between two contiguous tensors
of the chunk's size (the bandwidth floor). It calls the ops the connector
uses, :class:`TorchOps` everywhere and :class:`TritonOps` on CUDA, over KV
caches built by vLLM's own allocator in the layout a backend gets:

- ``--backend FLASH_ATTN`` (default on CUDA; also TRITON_ATTN, FLEX_ATTENTION,
  FLASHINFER): ``[blocks, H, N, 2D]`` views in ``--layout`` (default LBNHC,
  what vLLM resolves for them on Hopper);
- ``--backend CPU_ATTN`` (default on CPU): the ``vec`` kernels' packing.

The request's blocks are drawn shuffled from a pool twice its size. "MB" is
the chunk's payload (K + V, all layers), counted once; GB/s is that payload
over the median time, and "% copy" the copy's time over the op's.

A warm RAG request loads several chunks a step. ``--chunks N`` (default 4
and 8) also times the same tokens stored as N chunks (each its own tensor,
each moved by its own delta) loaded into the request: ``load xN`` is one
``load_chunks`` call (one launch with the Triton ops; a loop with torch's),
``loop xN`` one ``load_chunk`` per chunk, what the worker did before.

    python benchmarks/rerotate_copy_micro.py --device cuda --model llama-8b
    .venv/bin/python benchmarks/rerotate_copy_micro.py --device cpu
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable

import torch
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm_kvreuse.device import ChunkLoad, ChunkPiece, DeviceOps, PagedKV, Rope
from vllm_kvreuse.device.layouts import content_packed_views, cpu_attn_views
from vllm_kvreuse.device.torch_ops import TorchOps
from vllm_kvreuse.testing.kv_caches import KVShape, allocate

DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
MODELS = {
    # layers, KV heads, head size, RoPE base
    "qwen2-0.5b": (24, 2, 64, 1e6),
    "llama-8b": (32, 8, 128, 5e5),
}


def rope_table(head_size: int, max_pos: int, base: float, device) -> Rope:
    """Neox RoPE over the whole head: ``[max_pos, head_size]`` cos | sin."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_size, 2) / head_size)
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    table = torch.cat((angles.cos(), angles.sin()), dim=-1).to(device)
    return Rope(table, head_size, head_size, is_neox_style=True)


def paged_layers(args, shape: KVShape, num_blocks: int) -> list[PagedKV]:
    """Views of caches allocated as a worker of ``args.backend`` gets them."""
    if args.backend == "ASCEND":
        from vllm_kvreuse.device.npu import ascend_views
        from vllm_kvreuse.testing.ascend_layout import ascend_layer

        return [
            ascend_views(
                ascend_layer(num_blocks, shape.num_kv_heads, shape.head_size,
                             shape.dtype, block_size=args.block_size,
                             device=args.device),
                args.block_size,
            )
            for _ in range(shape.num_layers)
        ]  # fmt: skip
    if args.backend == "CPU_ATTN":
        caches = allocate(shape, num_blocks, args.block_size, KVCacheLayout.LBHNC)
        return [cpu_attn_views(c, args.block_size, "vec") for c in caches.values()]
    layout = KVCacheLayout[args.layout]
    caches = allocate(shape, num_blocks, args.block_size, layout, args.device)
    return [content_packed_views(c, shape.head_size) for c in caches.values()]


def time_it(fn: Callable[[], object], device, warmup: int, repeats: int) -> float:
    """Median seconds of one call."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type in ("cuda", "npu"):
            accelerator = getattr(torch, device.type)
            start = accelerator.Event(enable_timing=True)
            end = accelerator.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def all_ops(args, layers: list[PagedKV], rope: Rope) -> dict[str, DeviceOps]:
    ops: dict[str, DeviceOps] = {"torch": TorchOps(layers, rope)}
    if args.device.type == "cuda":
        from vllm_kvreuse.device.triton_ops import TritonOps

        ops["triton"] = TritonOps(layers, rope)
        ops["triton gather"] = TritonOps(layers, rope)  # rotation element-wise
        ops["triton gather"].HALVES = False
        for tile, warps in triton_variants(args):
            variant = TritonOps(layers, rope)
            variant.TILE, variant.NUM_WARPS = tile, warps
            ops[f"triton {tile}/{warps}"] = variant
    if args.backend == "ASCEND":  # on a CPU too: its torch path, for a check
        from vllm_kvreuse.device.npu import AscendOps

        ops["ascend"] = AscendOps(layers, rope)
    return ops


def triton_variants(args) -> list[tuple[int, int]]:
    """(tile, warps) pairs of ``--tiles`` x ``--warps`` other than the
    shipped ones: the kernel's launch shape, measured side by side."""
    from vllm_kvreuse.device.triton_ops import TritonOps

    shipped = (TritonOps.TILE, TritonOps.NUM_WARPS)
    pairs = [(t, w) for t in args.tiles or [] for w in args.warps or [shipped[1]]]
    return [pair for pair in pairs if pair != shipped]


def check_agreement(
    ops: dict[str, DeviceOps], table, stored, delta, pieces: list[ChunkPiece]
) -> None:
    """Every implementation saves what the torch reference saves after each
    loads the chunk with a delta, then ``pieces`` in one call (same cache,
    loaded in turn)."""
    tokens = stored.shape[2]
    single, batched = {}, {}
    for name, impl in ops.items():
        impl.load_chunk(table, 0, stored, 0, tokens, delta)
        single[name] = impl.save_chunk(table, 0, tokens)
        impl.load_chunks([ChunkLoad(table, pieces)])
        batched[name] = impl.save_chunk(table, 0, tokens)
    for name in ops:
        close = torch.testing.assert_close
        close(single[name], single["torch"], msg=f"{name} vs torch")
        close(batched[name], batched["torch"], msg=f"{name} x{len(pieces)} vs torch")


def request_chunks(stored: torch.Tensor, num_chunks: int, delta: int):
    """``stored``'s tokens as ``num_chunks`` chunks of (nearly) equal length,
    each its own tensor, each loaded where it stands in the request, moved
    by its own delta (``delta``, ``delta - 1``, ...)."""
    tokens = stored.shape[2]
    bounds = [round(i * tokens / num_chunks) for i in range(num_chunks + 1)]
    return [
        ChunkPiece(stored[:, :, a:b].clone(), 0, a, b - a, delta - i)
        for i, (a, b) in enumerate(itertools.pairwise(bounds))
    ]


def run_model(args, model: str) -> list[dict[str, float | str]]:
    num_layers, kv_heads, head_size, base = MODELS[model]
    shape = KVShape(num_layers, kv_heads, head_size, DTYPES[args.dtype])
    rope = rope_table(head_size, args.delta + 1, base, args.device)
    return [
        {"model": model, "tokens": tokens, **measure(args, shape, rope, tokens)}
        for tokens in args.tokens
    ]


def measure(args, shape: KVShape, rope: Rope, tokens: int) -> dict[str, float]:
    """Payload bytes and median seconds of the copy and of every op."""
    needed = -(-tokens // args.block_size)
    layers = paged_layers(args, shape, 2 * needed)
    gen = torch.Generator().manual_seed(tokens)
    table = torch.randperm(2 * needed, generator=gen)[:needed].to(args.device)
    chunk = (shape.num_layers, 2, tokens, shape.num_kv_heads, shape.head_size)
    stored = torch.randn(chunk, generator=gen).to(args.device, shape.dtype)
    target = torch.empty_like(stored)
    ops = all_ops(args, layers, rope)
    requests = {n: request_chunks(stored, n, args.delta) for n in args.chunks}
    if tokens == args.tokens[0]:
        most = requests[max(args.chunks)] if requests else []
        check_agreement(ops, table, stored, args.delta, most)

    def timed(fn: Callable[[], object]) -> float:
        return time_it(fn, args.device, args.warmup, args.repeats)

    result = {"bytes": stored.nbytes, "copy": timed(lambda: target.copy_(stored))}
    for name, impl in ops.items():
        result[f"{name} load"] = timed(
            lambda impl=impl: impl.load_chunk(table, 0, stored, 0, tokens, args.delta)
        )
        result[f"{name} save"] = timed(
            lambda impl=impl: impl.save_chunk(table, 0, tokens)
        )
        if name == "triton":  # what the rotation costs: the same load, unmoved
            result[f"{name} load unmoved"] = timed(
                lambda impl=impl: impl.load_chunk(table, 0, stored, 0, tokens, 0)
            )
        if name not in ("torch", "triton"):  # the shipped ops only
            continue
        for n, pieces in requests.items():  # the same tokens as n chunks
            load = ChunkLoad(table, pieces)
            result[f"{name} load x{n}"] = timed(
                lambda impl=impl, load=load: impl.load_chunks([load])
            )
            result[f"{name} loop x{n}"] = timed(
                lambda impl=impl, load=load: load_one_by_one(impl, load)
            )
    return result


def load_one_by_one(ops: DeviceOps, load: ChunkLoad) -> None:
    """``load``'s pieces as the worker loaded them before ``load_chunks``."""
    for piece in load.pieces:
        ops.load_chunk(load.block_ids, piece.dst_start, piece.stored,
                       piece.src_start, piece.count, piece.delta)  # fmt: skip


def markdown(rows: list[dict[str, float | str]]) -> str:
    ops = [k for k in rows[0] if k not in ("model", "tokens", "bytes")]
    header = (
        "| model | tokens | MB | "
        + " | ".join(f"{op} GB/s (% copy)" for op in ops)
        + " | "
        + " | ".join(f"{op} µs/1K tok" for op in ops)
        + " |"
    )
    lines = [header, "|---|" + "---:|" * (2 + 2 * len(ops))]
    for r in rows:
        cells = [str(r["model"]), str(r["tokens"]), f"{r['bytes'] / 1e6:.1f}"]
        for op in ops:
            rate, share = r["bytes"] / r[op] / 1e9, 100 * r["copy"] / r[op]
            cells.append(f"{rate:.1f} ({share:.0f}%)")
        cells += [f"{r[op] * 1024 / r['tokens'] * 1e6:.0f}" for op in ops]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def npu_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """vllm-ascend's layout: (k, v) per layer, 128-token blocks."""
    args.device = torch.device("npu")
    args.backend = "ASCEND"
    args.dtype = args.dtype or "bfloat16"
    args.tokens = args.tokens or [1024, 4096, 16384]
    args.block_size = args.block_size or 128
    args.repeats = args.repeats or 50
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda", "npu"],
                        default="cuda" if cuda else "cpu")  # fmt: skip
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None)
    parser.add_argument("--backend", default=None,
                        choices=["FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION",
                                 "FLASHINFER", "CPU_ATTN", "ASCEND"])  # fmt: skip
    parser.add_argument("--layout", choices=[m.name for m in KVCacheLayout],
                        default="LBNHC", help="for the CUDA backends")  # fmt: skip
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--delta", type=int, default=1000, help="position shift")
    parser.add_argument("--chunks", type=int, nargs="*", default=[4, 8],
                        help="also load the tokens as this many chunks, in "
                        "one load_chunks call and one by one")  # fmt: skip
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's)")  # fmt: skip
    parser.add_argument("--tiles", type=int, nargs="*", default=None,
                        help="CUDA: also time the Triton ops with these tiles "
                        "(elements a program moves per side)")  # fmt: skip
    parser.add_argument("--warps", type=int, nargs="*", default=None,
                        help="CUDA: ... and these warps per program")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    if args.device == "npu":
        try:
            import torch_npu  # noqa: F401  (registers the npu device)
        except ImportError:
            parser.error("--device npu needs torch_npu (Ascend CANN)")
        return npu_defaults(args)
    on_cuda = args.device == "cuda"
    if on_cuda and not cuda:
        parser.error("--device cuda but torch.cuda.is_available() is False")
    args.device = torch.device(args.device)
    args.backend = args.backend or ("FLASH_ATTN" if on_cuda else "CPU_ATTN")
    if args.backend == "CPU_ATTN" and on_cuda:
        parser.error("CPU_ATTN caches live on the CPU")
    args.dtype = args.dtype or ("bfloat16" if on_cuda else "float32")
    args.tokens = args.tokens or ([1024, 4096, 16384] if on_cuda else [1024, 4096])
    ascend = args.backend == "ASCEND"
    args.block_size = args.block_size or (128 if ascend else 16 if on_cuda else 32)
    args.repeats = args.repeats or (50 if on_cuda else 10)
    return args


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    where = (torch.cuda.get_device_name() if args.device.type == "cuda"
             else f"cpu ({torch.get_num_threads()} threads)")  # fmt: skip
    layout = "vec" if args.backend == "CPU_ATTN" else args.layout
    print(
        f"torch {torch.__version__}, {where}, {args.dtype}, {args.backend} "
        f"({layout}), block_size={args.block_size}, delta={args.delta}, "
        f"warmup={args.warmup}, repeats={args.repeats} (median)\n"
    )
    models = list(MODELS) if args.model == "all" else [args.model]
    print(markdown([row for model in models for row in run_model(args, model)]))


if __name__ == "__main__":
    main()
