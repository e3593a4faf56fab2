"""What the chunk cache costs requests that use no chunk: plain vLLM against
the same server with ``--enable-chunk-cache``, in one run.

Starts one `vllm serve` per configuration (all alive for the whole run) and
drives each with vLLM's own ``vllm bench serve`` (random dataset), its runs
interleaved (plain, cache, [hooks,] then the reverse order, ...) and
repeated, so that drift on a shared machine hits every configuration alike.
Each run's numbers come from ``--save-result``'s JSON. Prints per
configuration the median over runs of request throughput, median TPOT and
median TTFT, and each one's ratio to plain vLLM (throughput: higher is
better; TPOT and TTFT: lower is better).

The random dataset's prompts are plain text, so the cache server chunks none
of them: only a request's ``chunks`` field makes it chunked. The "chunks"
column counts the chunks the cache server looked up during the measured runs
(from ``/metrics``), so a table claiming "unused" shows 0. ``--separator
'##'`` starts the cache server with ``--chunk-separator '##'`` (the seed's
text format): about one random prompt in five contains ``##`` and is then
chunked (one, with an empty segment, refused).

Configurations:
- ``plain``: vLLM with the plugin installed and nothing switched on;
- ``cache``: ``--enable-chunk-cache`` (the connector and the scheduler layer);
- ``hooks`` (``--hooks``): the scheduler hook layer alone
  (``--engine-beam-search --enable-continuation --global-cache-hit-threshold 0``).

    .venv/bin/python benchmarks/chunk_cache_overhead.py [--repeats 5] [--hooks]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from vllm_kvreuse.testing.server import (
    SERVED_MODEL,
    VLLM,
    Server,
    ServerSettings,
)

CONFIGS: dict[str, list[str]] = {
    "plain": [],
    "cache": ["--enable-chunk-cache"],
    "hooks": [
        "--engine-beam-search", "--enable-continuation",
        "--global-cache-hit-threshold", "0",
    ],
}  # fmt: skip
METRICS = ("request_throughput", "median_tpot_ms", "median_ttft_ms")
LOOKUPS = tuple(f"vllm_kvreuse:chunk_cache_{c}_total" for c in ("hits", "misses"))


def bench(
    server: Server, model: str, args: argparse.Namespace, out: Path, name: str
) -> dict[str, float]:
    """One ``vllm bench serve`` run against ``server``: its saved metrics."""
    cmd = [
        VLLM, "bench", "serve", "--backend", "vllm", "--base-url", server.url,
        "--model", SERVED_MODEL, "--tokenizer", model,
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--ignore-eos",
        "--num-prompts", str(args.num_prompts),
        "--max-concurrency", str(args.concurrency), "--seed", str(args.seed),
        "--disable-tqdm", "--save-result", "--result-dir", str(out),
        "--result-filename", name,
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"vllm bench serve failed:\n{done.stdout}\n{done.stderr}")
    result = json.loads((out / name).read_text())
    if not result.get("completed"):
        raise RuntimeError(f"{name}: no request completed")
    if result.get("failed"):  # e.g. an empty segment with --separator '##'
        print(f"{name}: {result['failed']} request(s) failed", file=sys.stderr)
    return {metric: float(result[metric]) for metric in METRICS}


def chunk_lookups(server: Server) -> int:
    """Chunks the server looked up so far (0 on a server without the cache)."""
    return int(sum(server.metric(name) for name in LOOKUPS))


def table(results: dict[str, list[dict[str, float]]], chunks: dict[str, int]) -> str:
    """Medians over runs, and each configuration's ratio to ``plain``."""
    medians = {
        name: {m: statistics.median(run[m] for run in runs) for m in METRICS}
        for name, runs in results.items()
    }
    base = medians["plain"]
    lines = [
        "| server | runs | chunks | req/s | median TPOT (ms) | median TTFT (ms) "
        "| req/s vs plain | TPOT vs plain | TTFT vs plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in medians.items():
        ratios = " | ".join(f"{row[m] / base[m]:.3f}" for m in METRICS)
        lines.append(
            f"| {name} | {len(results[name])} | {chunks[name]} "
            f"| {row['request_throughput']:.2f} "
            f"| {row['median_tpot_ms']:.2f} | {row['median_ttft_ms']:.2f} "
            f"| {ratios} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hooks", action="store_true", help="add the hook layer")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--separator", default="", help="the cache server's --chunk-separator"
    )
    ServerSettings.add_arguments(parser)
    args = parser.parse_args()
    settings = ServerSettings.from_args(args)
    names = ["plain", "cache"] + (["hooks"] if args.hooks else [])
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        servers: dict[str, Server] = {}
        try:
            for name in names:
                extra = (
                    ["--chunk-separator", args.separator]
                    if name == "cache" and args.separator
                    else []
                )
                servers[name] = Server(
                    args.model, "--max-model-len", str(args.max_model_len),
                    *CONFIGS[name], *extra, log_path=out / f"{name}.log",
                    settings=settings,
                )  # fmt: skip
            for name in names:  # warm-up, not counted
                bench(servers[name], args.model, args, out, f"warmup-{name}.json")
            before = {name: chunk_lookups(server) for name, server in servers.items()}
            for repeat in range(args.repeats):
                order = names if repeat % 2 == 0 else names[::-1]
                for name in order:
                    run = bench(servers[name], args.model, args, out, f"{name}.json")
                    results[name].append(run)
                    print(f"round {repeat} {name}: {run}", file=sys.stderr)
            chunks = {
                name: chunk_lookups(server) - before[name]
                for name, server in servers.items()
            }
        finally:
            for server in servers.values():
                server.close()
    print(
        f"vllm bench serve: random {args.input_len} in / {args.output_len} out, "
        f"{args.num_prompts} prompts, concurrency {args.concurrency}; "
        f"medians of {args.repeats} interleaved runs"
    )
    print(table(results, chunks))


if __name__ == "__main__":
    main()
