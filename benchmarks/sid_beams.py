"""Generative-recommendation beams on FlashRec's terms: widths, concurrency,
catalog, plain vLLM beside ours in one run.

A RecIF-shaped workload scaled by flags: prompts of ``--prompt-tokens``
tokens, items of 3 semantic-ID tokens from 3 codebooks of ``--codebook``
codes (token ids from ``--token-base``), a synthetic catalog of ``--items``
items. Three modes, each a server of its own (started together):

- ``plain``: vLLM's own beam search (in the API server, one engine request
  per beam per step), open vocabulary;
- ``engine``: ``--engine-beam-search``, open vocabulary;
- ``catalog``: ``--engine-beam-search --sid-catalog``, beams kept in the
  catalog (``sid_catalog: true``).

Reports, per mode: stage-2 latency (one request alone) against width;
saturated throughput (requests per second) against concurrency at the
``--saturation-widths``; and the share of returned beams that are not
catalog items (illegal SIDs). ``--two-stage`` adds the OpenOneRec flow,
which none of the anchors has: a "thinking" stage of ``--thinking-tokens``
tokens, then the item's beams. Plain vLLM sends stage 2 as prompt +
thinking + suffix token ids (its prefix cache finds the prompt); ours
retains stage 1's KV (``retain_kv``) and continues it (``continuation_of``)
with catalog-constrained beams in the engine.

    .venv/bin/python benchmarks/sid_beams.py                          # CPU, tiny
    python benchmarks/sid_beams.py --model models/small --codebook 8192 \\
        --prompt-tokens 2500 --items 100000                            # a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from vllm_kvreuse.testing.server import SERVED_MODEL, ServerSettings, metric
from vllm_kvreuse.testing.server_group import ServerSpec, StartTimes, start_servers

MODES = ("plain", "engine", "catalog")


def write_catalog(path: Path, args: argparse.Namespace) -> set[tuple[int, ...]]:
    rng = random.Random(args.seed)
    items: set[tuple[int, ...]] = set()
    while len(items) < args.items:
        items.add(
            tuple(args.token_base + k * args.codebook + rng.randrange(args.codebook)
                  for k in range(3))
        )  # fmt: skip
    offsets = " ".join(str(args.token_base + k * args.codebook) for k in range(3))
    header = [
        "# sid-catalog v1", "# layout: codes",
        f"# codebooks: {args.codebook} {args.codebook} {args.codebook}",
        f"# token-offsets: {offsets}",
    ]  # fmt: skip
    body = (
        " ".join(str(t - args.token_base - k * args.codebook) for k, t in enumerate(i))
        for i in sorted(items)
    )
    path.write_text("\n".join([*header, *body]) + "\n")
    return items


def fresh(args: argparse.Namespace) -> int:
    """The next prompt's number. Every call gets a prompt of its own, so no
    call finds another's prefix cached and every call pays its prefill (as
    RecIF's distinct users do); the sequence restarts for each server, so
    every mode gets the same prompts."""
    return next(args.prompt_numbers)


def prompt(i: int, args: argparse.Namespace) -> list[int]:
    rng = random.Random(args.seed * 7919 + i)
    return [rng.randrange(10, args.token_base) for _ in range(args.prompt_tokens)]


async def beam(
    client: httpx.AsyncClient, mode: str, i: int, width: int, args
) -> tuple[float, list[tuple[int, ...]]]:
    body = {
        "model": SERVED_MODEL, "prompt": prompt(i, args), "max_tokens": 3,
        "use_beam_search": True, "n": width, "return_token_ids": True,
        "ignore_eos": True,  # an item is 3 tokens: EOS cannot end one
    }  # fmt: skip
    if mode == "catalog":
        body["sid_catalog"] = True
    start = time.perf_counter()
    response = await client.post("/v1/completions", json=body)
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    return elapsed, [tuple(c["token_ids"]) for c in response.json()["choices"]]


async def latency(url: str, mode: str, width: int, args) -> tuple[float, float]:
    """Median latency of ``args.repeats`` lone requests; the illegal share."""
    items, illegal, total, times = args.catalog_items, 0, 0, []
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        await beam(client, mode, fresh(args), width, args)  # warm-up
        for _ in range(args.repeats):
            seconds, beams = await beam(client, mode, fresh(args), width, args)
            times.append(seconds)
            illegal += sum(b not in items for b in beams)
            total += len(beams)
    return statistics.median(times), illegal / max(total, 1)


GROUP_COUNTERS = ("groups", "steps_as_one", "forks")


def group_counters(url: str) -> dict[str, float]:
    """The server's engine beam-group counters (zeros on vLLM's own)."""
    return {n: metric(url, f"vllm_kvreuse:beam_{n}_total") for n in GROUP_COUNTERS}


def per_group(before: dict[str, float], after: dict[str, float]) -> str:
    """What the groups between two readings did, each on average: steps
    run as one request, and forks (new member requests and moved beams)."""
    groups = after["groups"] - before["groups"]
    if not groups:
        return "-"
    as_one = (after["steps_as_one"] - before["steps_as_one"]) / groups
    forks = (after["forks"] - before["forks"]) / groups
    return f"{as_one:.1f} steps as one, {forks:.0f} forks"


async def saturate(call, concurrency: int, per_client: int) -> float:
    """Calls per second with ``concurrency`` clients, each making
    ``per_client`` calls (``await call()``) back to back."""

    async def worker() -> None:
        for _ in range(per_client):
            await call()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return concurrency * per_client / (time.perf_counter() - start)


async def throughput(url: str, mode: str, width: int, concurrency: int, args):
    """Beam requests per second at ``concurrency``."""
    async with httpx.AsyncClient(
        base_url=url, timeout=3600,
        limits=httpx.Limits(max_connections=concurrency + 4),
    ) as client:  # fmt: skip
        return await saturate(
            lambda: beam(client, mode, fresh(args), width, args),
            concurrency, args.per_client,
        )  # fmt: skip


SUFFIX = 7  # the token after the thinking, before the item (say, <|sid_begin|>)


async def two_stage(
    client: httpx.AsyncClient, mode: str, i: int, width: int, args
) -> tuple[float, float, list[tuple[int, ...]]]:
    """(whole call, stage 2 alone, beams) of one think-then-recommend call."""
    first = {
        "model": SERVED_MODEL, "prompt": prompt(i, args), "ignore_eos": True,
        "max_tokens": args.thinking_tokens, "return_token_ids": True,
    }  # fmt: skip
    if mode == "catalog":
        first["retain_kv"] = True
    start = time.perf_counter()
    response = await client.post("/v1/completions", json=first)
    response.raise_for_status()
    parent = response.json()
    second = {
        "model": SERVED_MODEL, "max_tokens": 3, "use_beam_search": True,
        "n": width, "return_token_ids": True, "ignore_eos": True,
    }  # fmt: skip
    if mode == "catalog":
        second |= {
            "prompt": [], "continuation_of": parent["id"], "sid_catalog": True,
            "continuation_suffix_token_ids": [SUFFIX],
        }  # fmt: skip
    else:
        thought = parent["choices"][0]["token_ids"]
        second["prompt"] = [*first["prompt"], *thought, SUFFIX]
    middle = time.perf_counter()
    response = await client.post("/v1/completions", json=second)
    end = time.perf_counter()
    response.raise_for_status()
    beams = [tuple(c["token_ids"]) for c in response.json()["choices"]]
    return end - start, end - middle, beams


async def two_stage_runs(url: str, mode: str, width: int, args) -> dict:
    """Lone calls (median whole and stage-2 latency, illegal share) and
    requests per second at each ``args.concurrency``."""
    items, illegal, total, whole, stage2 = args.catalog_items, 0, 0, [], []
    async with httpx.AsyncClient(
        base_url=url, timeout=3600,
        limits=httpx.Limits(max_connections=max(args.concurrency) + 4),
    ) as client:  # fmt: skip
        await two_stage(client, mode, fresh(args), width, args)  # warm-up
        for _ in range(args.repeats):
            seconds, second, beams = await two_stage(
                client, mode, fresh(args), width, args
            )
            whole.append(seconds)
            stage2.append(second)
            illegal += sum(b not in items for b in beams)
            total += len(beams)
        qps = {
            c: await saturate(
                lambda: two_stage(client, mode, fresh(args), width, args),
                c,
                args.per_client,
            )
            for c in args.concurrency
        }
    return {
        "whole": statistics.median(whole), "stage2": statistics.median(stage2),
        "illegal": illegal / max(total, 1), "qps": qps,
    }  # fmt: skip


def server_args(mode: str, catalog: Path, args) -> list[str]:
    common = ["--max-logprobs", str(2 * max(args.widths) + 1)]
    length = args.prompt_tokens + 64 + (args.thinking_tokens if args.two_stage else 0)
    common += ["--max-model-len", str(length)]
    if args.max_num_seqs:
        common += ["--max-num-seqs", str(args.max_num_seqs)]
    if mode == "plain":
        return common
    extra = ["--engine-beam-search"]
    if mode == "catalog":
        extra += ["--enable-continuation"] if args.two_stage else []
        extra += [
            "--sid-catalog",
            str(catalog),
            "--logprobs-mode",
            "processed_logprobs",
        ]
    return common + extra


def measure_mode(url: str, mode: str, args) -> dict:
    """Latency at ``args.widths``, throughput at ``args.saturation_widths``
    and ``args.concurrency``, two-stage calls if asked, on the server at
    ``url`` started for ``mode``."""
    args.prompt_numbers = itertools.count()
    lat = {w: asyncio.run(latency(url, mode, w, args)) for w in args.widths}
    qps, groups = {}, {}
    for w in args.saturation_widths:
        for c in args.concurrency:
            before = group_counters(url)
            qps[(w, c)] = asyncio.run(throughput(url, mode, w, c, args))
            groups[(w, c)] = per_group(before, group_counters(url))
    chains = {}
    if args.two_stage and mode in ("plain", "catalog"):
        chains = {
            w: asyncio.run(two_stage_runs(url, mode, w, args))
            for w in args.saturation_widths
        }
    return {"latency": lat, "qps": qps, "groups": groups, "two_stage": chains}


def run_modes(modes: list[str], catalog: Path, args) -> dict[str, dict]:
    """One server per mode, started together; each mode measured alone."""
    settings = ServerSettings.from_args(args)
    specs = [
        ServerSpec(mode, args.model, server_args(mode, catalog, args),
                   settings=settings)
        for mode in modes
    ]  # fmt: skip
    logs = Path(tempfile.mkdtemp())
    times = StartTimes()
    servers = start_servers(specs, logs, args.ready_timeout, times=times)
    print(f"servers: {times.summary()}; logs in {logs}", flush=True)
    try:
        return {mode: measure_mode(servers[mode].url, mode, args) for mode in modes}
    finally:
        for server in servers.values():
            server.close()


def report(results: dict[str, dict], args) -> None:
    print(f"\nmodel {args.model}, prompt {args.prompt_tokens} tokens, 3 SID tokens, "
          f"3 codebooks of {args.codebook}, catalog {args.items} items")  # fmt: skip
    modes = list(results)
    heads = " | ".join(f"{m} p50" for m in modes)
    names = ", ".join(modes)
    print(f"\n| width | {heads} | plain / catalog | illegal SIDs ({names}) |")
    print("|---:|" + "---:|" * len(modes) + "---:|---|")
    for w in args.widths:
        lat = [results[m]["latency"][w] for m in modes]
        ratio = lat[0][0] / lat[-1][0]
        cells = " | ".join(f"{s * 1e3:.0f} ms" for s, _ in lat)
        illegal = ", ".join(f"{share:.0%}" for _, share in lat)
        print(f"| {w} | {cells} | {ratio:.2f}x | {illegal} |")
    print("\n| width | concurrency | " + " | ".join(f"{m} req/s" for m in modes)
          + " | catalog / plain |")  # fmt: skip
    print("|---:|---:|" + "---:|" * len(modes) + "---:|")
    for w in args.saturation_widths:
        for c in args.concurrency:
            qps = [results[m]["qps"][(w, c)] for m in modes]
            cells = " | ".join(f"{q:.2f}" for q in qps)
            print(f"| {w} | {c} | {cells} | {qps[-1] / qps[0]:.2f}x |")
    print("\nA group under load, on average (the server's counters):")
    for w in args.saturation_widths:
        for c in args.concurrency:
            for m in modes:
                print(f"- width {w}, {c} clients, {m}: {results[m]['groups'][(w, c)]}")
    if args.two_stage and {"plain", "catalog"} <= set(results):
        report_two_stage(
            results["plain"]["two_stage"], results["catalog"]["two_stage"], args
        )


def report_two_stage(plain: dict, ours: dict, args) -> None:
    print(
        f"\ntwo-stage: {args.thinking_tokens} thinking tokens, then 3 SID tokens; "
        "plain = token ids + frontend beams, ours = continuation + catalog beams"
    )
    print(
        "\n| width | plain call p50 | ours call p50 | plain stage 2 p50 "
        "| ours stage 2 p50 | stage 2 plain / ours | illegal SIDs (plain, ours) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---|")
    for w in args.saturation_widths:
        a, b = plain[w], ours[w]
        print(f"| {w} | {a['whole'] * 1e3:.0f} ms | {b['whole'] * 1e3:.0f} ms "
              f"| {a['stage2'] * 1e3:.0f} ms | {b['stage2'] * 1e3:.0f} ms "
              f"| {a['stage2'] / b['stage2']:.2f}x "
              f"| {a['illegal']:.0%}, {b['illegal']:.0%} |")  # fmt: skip
    print("\n| width | concurrency | plain calls/s | ours calls/s | ours / plain |")
    print("|---:|---:|---:|---:|---:|")
    for w in args.saturation_widths:
        for c in args.concurrency:
            a, b = plain[w]["qps"][c], ours[w]["qps"][c]
            print(f"| {w} | {c} | {a:.2f} | {b:.2f} | {b / a:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--codebook", type=int, default=1024)
    parser.add_argument("--token-base", type=int, default=600)
    parser.add_argument("--items", type=int, default=20000)
    parser.add_argument("--widths", type=int, nargs="+", default=[8, 32, 128, 512])
    parser.add_argument("--saturation-widths", type=int, nargs="+", default=[50])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--per-client", type=int, default=2)
    parser.add_argument(
        "--max-num-seqs", type=int, default=None,
        help="every server's running requests (default: vLLM's, 128 on a CPU "
        "server: two groups of width 50)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--two-stage", action="store_true")
    parser.add_argument("--thinking-tokens", type=int, default=64)
    parser.add_argument("--plot", type=Path, help="write latency vs width (SVG)")
    ServerSettings.add_arguments(parser)
    args = parser.parse_args()
    catalog = Path(tempfile.mkdtemp()) / "catalog.txt"
    args.catalog_items = write_catalog(catalog, args)
    results = run_modes(args.modes.split(","), catalog, args)
    report(results, args)
    if args.plot:
        from svg_plot import line_chart  # benchmarks/ is on sys.path when run

        line_chart(
            {m: [(w, r["latency"][w][0] * 1e3) for w in args.widths]
             for m, r in results.items()},
            args.plot,
            f"Stage-2 beam search latency ({Path(args.model).name})",
            "beam width", "latency of one request alone, ms (p50)",
        )  # fmt: skip
        print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
