"""Build, mask and step times of a SID catalog (RecIF-like shape).

A synthetic catalog of N items of 3 codes from 3 codebooks of 8,192 (codes
uniform at random, the worst case for the trie's size), written in the
``--sid-catalog`` format, then:
- parse + build time and the trie's memory;
- per beam batch B, at the level of step 1 (all beams at the root, as when
  B/width groups start at once: 8,192 children each, a dense level), step 2
  (nodes with ~N/8192 children) and step 3 (nodes with ~1 child):
  ``allowed_mask`` ([B, V] bool), ``mask_logprobs`` ([B, V], new and in
  place), and one constrained ``step`` at width B (mask before top-k, then
  the policy's ranking), from [B, V] log-probs.

    .venv/bin/python benchmarks/sid_catalog_micro.py [--items 1000000]
        [--beams 64 1024] [--device cpu] [--threads 1]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from vllm_kvreuse.beam.catalog.file import load_catalog
from vllm_kvreuse.beam.rule import BeamConfig
from vllm_kvreuse.testing.catalog_reference import step

VOCAB = 160_000
CODEBOOK = 8192
OFFSETS = (135_424, 143_616, 151_808)  # the last code is token 159,999


def write_catalog(path: Path, num_items: int, seed: int = 0) -> None:
    codes = np.random.default_rng(seed).integers(0, CODEBOOK, size=(num_items, 3))
    header = (
        "# sid-catalog v1\n# layout: codes\n"
        f"# codebooks: {CODEBOOK} {CODEBOOK} {CODEBOOK}\n"
        f"# token-offsets: {' '.join(map(str, OFFSETS))}\n"
    )
    with path.open("w") as f:
        f.write(header)
        np.savetxt(f, codes, fmt="%d")


def timed(fn: Callable[[], object], device: torch.device, repeat: int = 5) -> float:
    """Fastest time of ``fn`` in ms, after a warm-up call (the minimum is the
    least disturbed by other work on a shared machine). CPU time of this
    process on CPU (with ``--threads 1``, the work itself, whatever else the
    machine runs), wall time on CUDA."""
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = clock()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((clock() - start) * 1e3)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--beams", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "catalog.txt"
        write_catalog(path, args.items)
        size_mb = path.stat().st_size / 2**20
        start, cpu_start = time.perf_counter(), time.process_time()
        catalog = load_catalog(path, VOCAB, eos_token_id=0, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        build_s = time.perf_counter() - start
        build_cpu_s = time.process_time() - cpu_start
    starts = catalog.level_starts.tolist()
    print(
        f"{args.items:,} items ({size_mb:.0f} MiB file): load + build {build_s:.2f} s "
        f"(CPU {build_cpu_s:.2f} s); "
        f"{catalog.num_items:,} distinct, {catalog.num_nodes:,} nodes, "
        f"{catalog.nbytes / 2**20:.1f} MiB of tensors, dense levels "
        f"{sorted(catalog.dense)}"
    )
    rng = np.random.default_rng(1)
    for beams in args.beams:
        logprobs = torch.log_softmax(torch.randn(beams, VOCAB, device=device), dim=-1)
        config = BeamConfig(width=beams, max_tokens=3, eos_token_id=0)
        for level in (0, 1, 2):
            nodes = torch.from_numpy(
                rng.integers(starts[level], starts[level + 1], size=beams)
            ).to(device)
            mask_ms = timed(lambda n=nodes: catalog.allowed_mask(n), device)
            masked_ms = timed(
                lambda n=nodes, lp=logprobs: catalog.mask_logprobs(lp, n), device
            )
            step_ms = timed(
                lambda n=nodes, lp=logprobs, c=config: step(
                    catalog, lp, np.zeros(len(n)), n, c
                ),
                device,
            )
            scratch = logprobs.clone()  # masked in place over and over
            inplace_ms = timed(
                lambda n=nodes, lp=scratch: catalog.mask_logprobs(lp, n, inplace=True),
                device,
            )
            print(
                f"B={beams:5d} step {level + 1}: allowed_mask {mask_ms:7.2f} ms, "
                f"mask_logprobs {masked_ms:7.2f} ms (in place {inplace_ms:7.2f} ms), "
                f"step {step_ms:7.2f} ms"
            )


if __name__ == "__main__":
    main()
