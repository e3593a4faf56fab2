"""The workers' beam selection alone: time and bytes a step, either path.

One step of ``--groups`` groups of width ``--width`` over ``--vocab``
log-probs (random logits rounded to bfloat16, so rows tie as a bfloat16
model's do), on ``--device``: the fixed-shape path (an accelerator's, no
host sync) and the pruned one (CPU's). Prints each path's median time a
step (CUDA: synchronised per call, so device time included) and the bytes
its operations read and write over whole ``[R, V]`` tensors (views,
gathers and scatters left out), which on a GPU bound its device time.

Usage (the H200's 16 x 50 step of the GPU report, ``models/small``'s
vocabulary)::

    .venv/bin/python benchmarks/beam_select_micro.py --groups 16 --vocab 32768
    python3 benchmarks/beam_select_micro.py --device cuda --groups 16 --vocab 32768
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from vllm_kvreuse.beam.worker.segments import Segments
from vllm_kvreuse.beam.worker.select import logprobs_of, select_rows
from vllm_kvreuse.testing.row_passes import RowPasses


def _median_ms(step: Callable[[], object], device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])  # the first warms up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--width", type=int, default=50)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--eos", type=int, default=-1, help="EOS id (-1: ignore_eos)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # a vLLM worker on CPU runs one OpenMP thread here
    device = torch.device(args.device)
    rows = args.groups * args.width
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, args.vocab, generator=generator).mul_(3)
    logprobs = logprobs_of(logits.bfloat16().float().to(device))
    seg = Segments.of(
        [args.width] * args.groups, [args.width] * args.groups,
        [args.eos] * args.groups, [2 * args.width] * args.groups, device,
    )  # fmt: skip
    cum = torch.zeros(rows, dtype=torch.float64, device=device)
    print(
        f"{args.groups} groups x width {args.width}, vocabulary {args.vocab}, "
        f"EOS {args.eos}, {device}; ms a step (median of {args.repeats})"
    )
    print(f"{'path':<8}{'ms':>10}{'passes':>8}{'GB':>8}{'bytes/element':>15}")
    for name, fixed in (("fixed", True), ("pruned", False)):
        if fixed is False and device.type != "cpu":
            continue  # the pruned path syncs with the host: CPU only

        def step(fixed: bool = fixed) -> object:
            return select_rows(logprobs, cum, seg, fixed=fixed)

        ms = _median_ms(step, device, args.repeats)
        with RowPasses((rows, args.vocab)) as counted:
            step()
        per = counted.bytes / (rows * args.vocab)
        print(
            f"{name:<8}{ms:>10.2f}{len(counted.names):>8}"
            f"{counted.bytes / 1e9:>8.2f}{per:>15.0f}"
        )


if __name__ == "__main__":
    main()
