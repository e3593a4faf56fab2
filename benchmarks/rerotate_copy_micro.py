"""Micro-benchmark: re-rotate keys with RoPE + copy into a paged KV cache.

Measures what loading one stored chunk into a request's KV slots costs when
its keys must be moved to new positions (the chunk cache's ``load_chunk``),
next to copying the same bytes without any work. For each token count it
times, over all layers (keys and values apart, one cache tensor per layer):

- plain copy: ``dst.copy_(src)`` between preallocated contiguous ``[n, H, D]``
  tensors on the same device (the bandwidth floor);
- scatter only: ``cache_k[blocks, offsets] = keys`` (and values) into a
  paged view ``[num_blocks, block_size, H, D]`` of a ``[2, num_blocks,
  block_size, H, D]`` cache, slots drawn from shuffled blocks;
- rotate + scatter (v1): keys re-rotated by a position delta (neox RoPE,
  float32, from a ``[max_pos, rotary_dim]`` float32 cos/sin cache) with a
  position per token, layer by layer, then scattered as above (the first
  version of ``ops.load_chunk``);
- load_chunk (current): one cos/sin row for the whole chunk; on CUDA all
  layers' keys rotated in one pass, on CPU layer by layer (as
  ``ops.load_chunk`` does now), then scattered.

It needs torch alone: the arithmetic mirrors ``vllm_kvreuse/ops.py``
(``rerotate_keys`` -> vLLM's ``ApplyRotaryEmb.forward_static``;
``write_tokens``; ``load_chunk``) op for op, re-implemented here so that it
runs where vLLM is not installed. The v1 variant mirrors the first version of
``ops`` (a position per token through ``RotaryEmbedding.forward_static``).

    python benchmarks/rerotate_copy_micro.py --device cuda --dtype float16
    .venv/bin/python benchmarks/rerotate_copy_micro.py --device cpu

Bytes moved counts the payload once (K + V, all layers), not read + write;
GB/s is that payload over the measured time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def cos_sin_cache(
    max_pos: int, rotary_dim: int, base: float, device: torch.device
) -> torch.Tensor:
    """``[max_pos, rotary_dim]`` float32: cos in the first half, sin after."""
    inv_freq = 1.0 / (
        base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    )
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)


def rerotate_keys(
    keys: torch.Tensor,
    delta: torch.Tensor,
    cache: torch.Tensor,
    head_size: int,
    rotary_dim: int,
) -> torch.Tensor:
    """Keys ``[n, H, D]`` moved by ``delta[i]`` positions each, in float32.

    The first ``ops.rerotate_keys``: vLLM's ``forward_static`` inlined (neox).
    """
    num_tokens = keys.shape[0]
    flat = keys.reshape(num_tokens, -1).to(torch.float32)
    positions = delta.to(torch.long).flatten()
    cos_sin = cache.to(flat.device).index_select(0, positions)
    cos, sin = cos_sin.chunk(2, dim=-1)
    key = flat.view(num_tokens, -1, head_size)
    key_rot = key[..., :rotary_dim]
    key_pass = key[..., rotary_dim:]
    cos = cos.unsqueeze(-2).to(key_rot.dtype)
    sin = sin.unsqueeze(-2).to(key_rot.dtype)
    x1, x2 = torch.chunk(key_rot, 2, dim=-1)
    key_rot = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    rotated = torch.cat((key_rot, key_pass), dim=-1).reshape(flat.shape)
    return rotated.view(keys.shape)


def rerotate_const(
    keys: torch.Tensor, delta: int, cache: torch.Tensor, rotary_dim: int
) -> torch.Tensor:
    """``ops.rerotate_keys`` now: one position for all of ``keys [..., H, D]``."""
    cos, sin = cache[delta].chunk(2)
    x = keys.to(torch.float32)
    x1, x2 = torch.chunk(x[..., :rotary_dim], 2, dim=-1)
    cos, sin = cos[None, None], sin[None, None]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def write_tokens(
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """``ops.write_tokens``: ``[n, H, D]`` keys and values into the slots."""
    cache_k[blocks, offsets] = keys.to(cache_k.dtype)
    cache_v[blocks, offsets] = values.to(cache_v.dtype)


@dataclass
class Case:
    """Tensors of one token count: sources, copy targets, paged caches."""

    src_k: list[torch.Tensor]
    src_v: list[torch.Tensor]
    dst_k: list[torch.Tensor]
    dst_v: list[torch.Tensor]
    src_k_all: torch.Tensor  # [layers, n, H, D], as the chunk store keeps them
    caches: list[torch.Tensor]  # per layer [2, num_blocks, block_size, H, D]
    blocks: torch.Tensor
    offsets: torch.Tensor
    nbytes: int


def make_case(args: argparse.Namespace, tokens: int, device: torch.device) -> Case:
    dtype = DTYPES[args.dtype]
    shape = (tokens, args.kv_heads, args.head_size)
    token_bytes = args.kv_heads * args.head_size * torch.finfo(dtype).bits // 8
    gen = torch.Generator().manual_seed(tokens)

    def rand() -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)

    needed = -(-tokens // args.block_size)
    num_blocks = 2 * needed  # a pool twice the request; its blocks shuffled
    block_ids = torch.randperm(num_blocks, generator=gen)[:needed].to(device)
    positions = torch.arange(tokens, device=device)
    layers = range(args.layers)
    return Case(
        src_k=[rand() for _ in layers],
        src_v=[rand() for _ in layers],
        dst_k=[torch.empty(shape, dtype=dtype, device=device) for _ in layers],
        dst_v=[torch.empty(shape, dtype=dtype, device=device) for _ in layers],
        src_k_all=torch.randn((args.layers, *shape), generator=gen).to(device, dtype),
        caches=[
            torch.zeros(
                (2, num_blocks, args.block_size, args.kv_heads, args.head_size),
                dtype=dtype,
                device=device,
            )
            for _ in layers
        ],
        blocks=block_ids[positions // args.block_size],
        offsets=positions % args.block_size,
        nbytes=2 * args.layers * tokens * token_bytes,
    )


def time_it(
    fn: Callable[[], None], device: torch.device, warmup: int, repeats: int
) -> float:
    """Median seconds of one call of ``fn`` (all layers)."""
    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def check_rotation(cache: torch.Tensor, args: argparse.Namespace) -> None:
    """Rotating by a then b equals rotating by a + b (angles linear in pos)."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn((64, args.kv_heads, args.head_size), generator=gen)
    keys = keys.to(cache.device)
    a = torch.full((64,), 300, device=cache.device)
    b = torch.full((64,), 700, device=cache.device)
    hd, rd = args.head_size, args.rotary_dim
    twice = rerotate_keys(rerotate_keys(keys, a, cache, hd, rd), b, cache, hd, rd)
    once = rerotate_keys(keys, a + b, cache, hd, rd)
    err = (twice - once).abs().max().item()
    if err > 1e-3:
        raise SystemExit(f"rotation check failed: max abs error {err}")


def run(args: argparse.Namespace) -> list[dict[str, float]]:
    device = torch.device(args.device)
    cache = cos_sin_cache(args.max_pos, args.rotary_dim, args.rope_base, device)
    check_rotation(cache, args)
    hd, rd = args.head_size, args.rotary_dim
    rows = []
    for tokens in args.tokens:
        case = make_case(args, tokens, device)

        def plain_copy(case: Case = case) -> None:
            for layer in range(args.layers):
                case.dst_k[layer].copy_(case.src_k[layer])
                case.dst_v[layer].copy_(case.src_v[layer])

        def scatter(case: Case = case) -> None:
            for layer, kv in enumerate(case.caches):
                write_tokens(
                    kv[0],
                    kv[1],
                    case.blocks,
                    case.offsets,
                    case.src_k[layer],
                    case.src_v[layer],
                )

        def rotate_scatter(case: Case = case, tokens: int = tokens) -> None:
            # ops.load_chunk: a fresh shift tensor and rotation per layer.
            for layer, kv in enumerate(case.caches):
                keys = case.src_k[layer]
                shift = torch.full((tokens,), args.delta, device=keys.device)
                keys = rerotate_keys(keys, shift, cache, hd, rd)
                write_tokens(
                    kv[0], kv[1], case.blocks, case.offsets, keys, case.src_v[layer]
                )

        def load_chunk_now(case: Case = case) -> None:
            # ops.load_chunk: one rotation of all layers on CUDA, per layer on CPU.
            keys_all = case.src_k_all
            if device.type != "cpu":
                keys_all = rerotate_const(keys_all, args.delta, cache, rd)
            for layer, kv in enumerate(case.caches):
                keys = keys_all[layer]
                if device.type == "cpu":
                    keys = rerotate_const(keys, args.delta, cache, rd)
                write_tokens(
                    kv[0], kv[1], case.blocks, case.offsets, keys, case.src_v[layer]
                )

        t_copy = time_it(plain_copy, device, args.warmup, args.repeats)
        t_scatter = time_it(scatter, device, args.warmup, args.repeats)
        t_rot = time_it(rotate_scatter, device, args.warmup, args.repeats)
        t_now = time_it(load_chunk_now, device, args.warmup, args.repeats)
        per_1k = 1024 / tokens * 1e6
        rows.append(
            {
                "tokens": tokens,
                "mb": case.nbytes / 1e6,
                "copy_gbs": case.nbytes / t_copy / 1e9,
                "scatter_gbs": case.nbytes / t_scatter / 1e9,
                "rot_gbs": case.nbytes / t_rot / 1e9,
                "scatter_ratio": t_scatter / t_copy,
                "rot_ratio": t_rot / t_copy,
                "copy_us_1k": t_copy * per_1k,
                "scatter_us_1k": t_scatter * per_1k,
                "rot_us_1k": t_rot * per_1k,
                "now_ratio": t_now / t_copy,
                "now_us_1k": t_now * per_1k,
            }
        )
        del case
    return rows


def markdown(rows: list[dict[str, float]]) -> str:
    header = (
        "| tokens | MB moved (K+V, all layers) | copy GB/s | scatter GB/s "
        "| rotate+scatter GB/s | scatter / copy | rotate+scatter / copy "
        "| copy µs/1K tok | scatter µs/1K tok | rotate+scatter µs/1K tok "
        "| load_chunk (current) / copy | load_chunk (current) µs/1K tok |"
    )
    lines = [header, "|" + "---:|" * 12]
    for r in rows:
        lines.append(
            f"| {r['tokens']} | {r['mb']:.1f} | {r['copy_gbs']:.1f} "
            f"| {r['scatter_gbs']:.1f} | {r['rot_gbs']:.1f} "
            f"| {r['scatter_ratio']:.1f}x | {r['rot_ratio']:.1f}x "
            f"| {r['copy_us_1k']:.0f} | {r['scatter_us_1k']:.0f} "
            f"| {r['rot_us_1k']:.0f} | {r['now_ratio']:.1f}x "
            f"| {r['now_us_1k']:.0f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if cuda else "cpu"
    )
    parser.add_argument("--dtype", choices=list(DTYPES), default=None)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument(
        "--rotary-dim", type=int, default=None, help="default: head size"
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--delta", type=int, default=1000, help="position shift")
    parser.add_argument("--max-pos", type=int, default=32768)
    parser.add_argument("--rope-base", type=float, default=1e6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    on_cuda = args.device == "cuda"
    if on_cuda and not cuda:
        parser.error("--device cuda but torch.cuda.is_available() is False")
    if args.dtype is None:
        args.dtype = "float16" if on_cuda else "float32"
    if args.block_size is None:
        args.block_size = 16 if on_cuda else 32
    if args.repeats is None:
        args.repeats = 50 if on_cuda else 10
    if args.rotary_dim is None:
        args.rotary_dim = args.head_size
    if args.rotary_dim % 2 or args.rotary_dim > args.head_size:
        parser.error("--rotary-dim must be even and at most --head-size")
    if args.delta >= args.max_pos:
        parser.error("--delta must be below --max-pos")
    return args


def main() -> None:
    args = parse_args()
    if args.device == "cpu":
        where = f"cpu ({torch.get_num_threads()} threads)"
    else:
        where = torch.cuda.get_device_name()
    print(
        f"torch {torch.__version__}, {where}, {args.dtype}, layers={args.layers}, "
        f"kv_heads={args.kv_heads}, head_size={args.head_size}, "
        f"rotary_dim={args.rotary_dim}, block_size={args.block_size}, "
        f"delta={args.delta}, warmup={args.warmup}, repeats={args.repeats} "
        "(median)"
    )
    print()
    print(markdown(run(args)))


if __name__ == "__main__":
    main()
