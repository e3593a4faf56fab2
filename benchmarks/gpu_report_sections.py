"""The GPU report's measured sections, each run as a process of its own.

``python benchmarks/gpu_report_sections.py SECTION CONFIG_JSON`` prints the
section's Markdown and, last, one line ``RESULT {json}`` with the figures the
report's summary checks. :mod:`gpu_report` starts one such process per
section, kills it at the section's budget and keeps what it printed, so a
section that runs long never holds up the next.

Sections: ``env`` (device and software), ``rag``, ``beams``, ``two_stage``,
``micro`` and ``beam_steps``; the servers they talk to were started by the
report, their URLs are in the config (``micro`` and ``beam_steps`` run
after the servers are gone, on the idle device).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

Config = dict[str, Any]


def env(config: Config) -> dict:
    """One line: GPU, driver, CUDA, torch, Triton, vLLM, this plugin."""
    from importlib.metadata import version

    import torch
    import vllm

    if torch.cuda.is_available():
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        try:
            driver = subprocess.run(query, capture_output=True, text=True, timeout=20)
            driver_version = driver.stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            driver_version = "unknown"
        device = (
            f"{torch.cuda.get_device_name()} "
            f"({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB), "
            f"driver {driver_version}, CUDA {torch.version.cuda}"
        )
    else:
        device = (
            f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
        )
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    runner = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    runner = {"1": "V2", "0": "V1"}.get(runner or "", "vLLM's default (V2 on CUDA)")
    line = (
        f"{device}; torch {torch.__version__}, Triton {triton_version}, "
        f"vLLM {vllm.__version__}, vllm-kvreuse {version('vllm-kvreuse')} "
        f"({commit()}); model runner: {runner}"
    )
    print(line)
    return {"line": line}


def commit() -> str:
    """The checkout's commit, marked when the tree differs from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "commit unknown"
    if head.returncode:
        return "commit unknown"
    return f"commit {head.stdout.strip()}" + (
        " + changes" if dirty.stdout.strip() else ""
    )


RAG_ROWS = (
    ("plain, cold", "cold", "plain p50"),
    ("plain, prefix hit", "warm, plain again", "chunk p50"),
    ("chunk cache, first sight", "cold", "chunk p50"),
    ("chunk cache, default recompute", "warm", "chunk p50"),
    (
        'chunk cache, chunk_recompute "none"',
        'warm, chunk_recompute="none"',
        "chunk p50",
    ),
    ("chunk cache, paths", "warm, chunk_attention=paths", "chunk p50"),
    ("chunk cache, choose", "warm, chunk_attention=choose", "chunk p50"),
)
"""The summary rows of each RAG shape: (row, the benchmark's phase its
name starts with, which column)."""


def rag(config: Config) -> dict:
    """First-sight and warm TTFT, plain vLLM against the chunk cache, at
    each prompt shape; then one table of TTFTs and ratios to plain cold and
    to the prefix hit (the limit of reuse)."""
    import rag_chunk_cache as bench

    shapes: dict[str, dict[str, float]] = {}
    result: dict = {}
    for shape in config["shapes"]:
        args = argparse.Namespace(**shape)
        print(f"\n### {shape['label']} tokens: {shape['docs_per_prompt']} documents\n")
        rows = bench.measure(
            config["plain"], config["chunk"], bench.phase_prompts(args), args
        )
        print(bench.markdown(rows), flush=True)
        ttft = {
            name: next(r[column] for r in rows if r["phase"].startswith(phase))
            for name, phase, column in RAG_ROWS
        }
        shapes[shape["label"]] = ttft
        if not result:  # the first shape's figures, as the report always gave
            warm = next(r for r in rows if r["phase"] == "warm")
            result = {
                "first_sight": ttft["plain, cold"] / ttft[RAG_ROWS[2][0]],
                "warm_default": ttft["plain, cold"] / ttft[RAG_ROWS[3][0]],
                "warm_none": ttft["plain, cold"] / ttft[RAG_ROWS[4][0]],
                "warm_hit_rate": warm["hit_rate"],
            }
        print("RESULT " + json.dumps({**result, "shapes": shapes}), flush=True)
    print("\n" + rag_summary(shapes))
    return {**result, "shapes": shapes}


def rag_summary(shapes: dict[str, dict[str, float]]) -> str:
    """Each shape's rows: TTFT, plain cold / row, row / prefix hit."""
    lines = [
        "| tokens | row | TTFT p50 | plain cold / row | row / prefix hit |",
        "|---|---|---:|---:|---:|",
    ]
    for label, ttft in shapes.items():
        cold, hit = ttft["plain, cold"], ttft["plain, prefix hit"]
        for name, value in ttft.items():
            lines.append(
                f"| {label} | {name} | {value * 1e3:.0f} ms | "
                f"{cold / value:.2f}x | {value / hit:.2f}x |"
            )
    return "\n".join(lines)


def beams(config: Config) -> dict:
    """Engine beams against vLLM's beam search: throughput at the saturation
    width first (the headline), then latency at each width, the widest last
    and vLLM's own mode last of all (the slowest), each table printed as
    soon as it is complete."""
    import asyncio
    import itertools
    import tempfile

    import sid_beams as bench

    args = argparse.Namespace(**config["args"], two_stage=False)
    args.catalog_items = bench.write_catalog(Path(tempfile.mkdtemp()) / "c.txt", args)
    urls = config["urls"]
    width, concurrency = args.saturation_widths[0], args.concurrency[-1]
    qps, latency, groups = {}, {}, {}
    for mode, url in urls.items():
        args.prompt_numbers = itertools.count()
        latency[(mode, width)] = asyncio.run(bench.latency(url, mode, width, args))
        before = bench.group_counters(url)
        qps[mode] = asyncio.run(bench.throughput(url, mode, width, concurrency, args))
        groups[mode] = bench.per_group(before, bench.group_counters(url))
    print(
        f"Width {width}, {concurrency} clients, {args.per_client} requests each; "
        f"prompts of {args.prompt_tokens} tokens, 3 SID tokens, 3 codebooks of "
        f"{args.codebook}, a catalog of {args.items} items.\n"
    )
    print("| mode | requests/s | vs plain | p50 alone | illegal SIDs | a group |")
    print("|---|---:|---:|---:|---:|---|")
    for mode in urls:
        seconds, illegal = latency[(mode, width)]
        print(
            f"| {mode} | {qps[mode]:.2f} | {qps[mode] / qps['plain']:.2f}x | "
            f"{seconds * 1e3:.0f} ms | {illegal:.0%} | {groups[mode]} |"
        )
    print(
        "\nA group: what each engine beam search did under the clients' load, "
        "on average (its server's counters): steps run as one request, forks."
    )
    result = {
        "qps": qps,
        "catalog_over_plain": qps["catalog"] / qps["plain"],
        "illegal_catalog": latency[("catalog", width)][1],
    }
    print("RESULT " + json.dumps(result))
    print("\n| width | mode | p50 alone | illegal SIDs |\n|---:|---|---:|---:|")
    for w in [w for w in args.widths if w != width]:
        for mode in reversed(urls):  # vLLM's own last: the slowest
            args.prompt_numbers = itertools.count()
            seconds, illegal = asyncio.run(bench.latency(urls[mode], mode, w, args))
            print(f"| {w} | {mode} | {seconds * 1e3:.0f} ms | {illegal:.0%} |")
            result[f"latency {mode} {w}"] = seconds
    return result


def two_stage(config: Config) -> dict:
    """Modes (a)-(d) and stage 1 alone (OpenOneRec's think-then-recommend)."""
    import two_stage_openonerec as bench

    args = argparse.Namespace(**config["args"])
    results = bench.run_on(
        config["continuation"], ["text", "token_ids", "continuation"], args
    )
    results |= bench.run_on(config["engine"], ["engine_beam", "stage1_only"], args)
    try:
        bench.report(results, args)
    except SystemExit as error:  # beams differed between modes: say so, keep going
        print(f"**{error}**")
    return {"d_over_stage1": results["engine_beam"].wall / results["stage1_only"].wall}


def micro(config: Config) -> dict:
    """The chunk load and save against a copy of the same bytes."""
    import rerotate_copy_micro as bench

    args = bench.parse_args(config["argv"])
    print(
        f"{args.dtype}, {args.backend} ({args.layout}), {args.block_size}-token "
        f"blocks, delta {args.delta}, median of {args.repeats}\n"
    )
    rows = [row for model in bench.MODELS for row in bench.run_model(args, model)]
    ops = [k for k in rows[0] if k not in ("model", "tokens", "bytes", "copy")]
    print(
        "| model | tokens | MB | copy µs | "
        + " | ".join(f"{op} % copy" for op in ops)
        + " |"
    )
    print("|---|---:|---:|---:|" + "---:|" * len(ops))
    shares: dict[str, float] = {}
    for r in rows:
        cells = [f"{100 * r['copy'] / r[op]:.0f}%" for op in ops]
        print(
            f"| {r['model']} | {r['tokens']} | {r['bytes'] / 1e6:.1f} | "
            f"{r['copy'] * 1e6:.0f} | " + " | ".join(cells) + " |"
        )
        for op in ops:
            shares[f"{r['model']} {r['tokens']} {op}"] = r["copy"] / r[op]
    return {"share_of_copy": shares}


def beam_steps(config: Config) -> dict:
    """Where a beam step's time goes, in-process engines on the idle device:
    16 groups' step against their 800 members decoding (host parts, each
    waiting for the device), then every engine step of 16 searches on the
    report's prompts (steps a search takes, and what each costs), then the
    workers' selection of that step alone on the device (its time and the
    bytes it moves over the rows)."""
    here = Path(__file__).parent
    result: dict[str, float] = {}
    for script, line in (
        ("beam_step_overhead.py", config["overhead"]),
        ("beam_width_profile.py", config["profile"]),
        ("beam_select_micro.py", config["select"]),
    ):
        argv = line.split()
        done = subprocess.run(
            [sys.executable, str(here / script), *argv],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        print(f"`{script} {' '.join(argv)}`\n\n```text\n{done.stdout.strip()}\n```\n")
        if done.returncode:
            print(f"**exit {done.returncode}**: {done.stderr[-2000:]}")
        if m := re.search(r"overhead beams / decode: ([0-9.]+)x", done.stdout):
            result["host_beams_over_decode"] = float(m.group(1))
        if m := re.search(r"engine steps of one search, ms: ([0-9, ]+)", done.stdout):
            times = m.group(1).strip(" ,")
            result["steps_per_search"] = len(times.split(","))
        if m := re.search(r"^fixed\s+([0-9.]+)", done.stdout, re.MULTILINE):
            result["select_fixed_ms"] = float(m.group(1))
    ratio = result.get("host_beams_over_decode")
    steps = result.get("steps_per_search")
    print("| figure | value |\n|---|---:|")
    print(
        "| host time, a step of the groups / their members decoding | "
        f"{'not measured' if ratio is None else f'{ratio}x'} |"
    )
    print(f"| engine steps of one search | {steps or 'not measured'} |")
    select = result.get("select_fixed_ms")
    print(
        "| the step's selection alone, fixed shapes | "
        f"{'not measured' if select is None else f'{select} ms'} |"
    )
    return result


SECTIONS = {
    "env": env,
    "rag": rag,
    "beams": beams,
    "two_stage": two_stage,
    "micro": micro,
    "beam_steps": beam_steps,
}


def main() -> None:
    name, raw = sys.argv[1], sys.argv[2]
    sys.path.insert(0, str(Path(__file__).parent))  # the benchmarks beside it
    # Every line printed goes to the report at once (vLLM logs to stderr:
    # the report starts this with VLLM_LOGGING_STREAM set so).
    sys.stdout.reconfigure(line_buffering=True)
    result = SECTIONS[name](json.loads(raw))
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
