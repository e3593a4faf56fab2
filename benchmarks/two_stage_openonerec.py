"""Two-stage generative recommendation (OpenOneRec) against one `vllm serve`.

Stage 1 samples a "thinking" text (greedy here, so that every mode sees the
same text) that would end at `</think>`; stage 2 beam-searches semantic-id
tokens (width 32, 3 tokens) after `</think>\\n<|sid_begin|>`. Each request
runs its two stages back to back, `--concurrency` requests at a time, in three
modes against the same server (the prefix cache is reset between modes):

  (a) text:         stage 2 is a text prompt: stage-1 prompt + stage-1 text +
                    suffix (plain vLLM practice; re-tokenised)
  (b) token ids:    stage 2 is stage-1 prompt ids + output ids + suffix ids
                    (plain vLLM with prefix caching)
  (c) continuation: stage 2 names stage 1 by id (`continuation_of`), stage 1
                    asked for `retain_kv` (vllm-kvreuse)
  (d) engine_beam:  (c) on a second server started with `--engine-beam-search`:
                    beam search runs in the engine, beams fork their parent's
                    KV blocks (vllm-kvreuse)
  stage1_only:      stage 1 alone, on the second server: the physical limit of
                    the pipeline

Stage-2 prefill tokens computed are read from the server's /metrics
(`vllm:prompt_tokens_by_source{source="local_compute"}`) minus what stage 1
computed (from its usage). vLLM counts a request's first prefill there, not a
recomputation after preemption; preemptions are printed beside it.

    .venv/bin/python benchmarks/two_stage_openonerec.py               # ample pool
    .venv/bin/python benchmarks/two_stage_openonerec.py --kv-blocks 120  # tight pool
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from vllm_kvreuse.testing.server import SERVED_MODEL, ServerSettings, metric
from vllm_kvreuse.testing.server_group import ServerSpec, start_servers

SUFFIX = "</think>\n<|sid_begin|>"
FRONTEND_MODES = ("text", "token_ids", "continuation")
ENGINE_MODES = ("engine_beam", "stage1_only")
MODES = FRONTEND_MODES + ENGINE_MODES


@dataclass
class ModeResult:
    mode: str
    stage1_ttft: list[float] = field(default_factory=list)
    stage2_latency: list[float] = field(default_factory=list)
    stage1_computed: int = 0
    stage2_prompt_tokens: int = 0
    beams: dict[int, list[str]] = field(default_factory=dict)
    wall: float = 0.0
    computed_total: float = 0.0
    preemptions: float = 0.0
    engine_requests: float = 0.0  # finished engine requests plus beam forks

    @property
    def stage2_computed(self) -> float:
        return self.computed_total - self.stage1_computed


def user_prompt(i: int, words: int) -> str:
    history = " ".join(f"item{(i * 7919 + j * 104729) % 5003}" for j in range(words))
    return f"<|im_start|>user\nUser {i} watched: {history}\nRecommend.<|im_end|>\n" \
        "<|im_start|>assistant\n<think>"  # fmt: skip


async def stage1(client: httpx.AsyncClient, prompt: str, args, retain: bool) -> dict:
    body = {
        "model": SERVED_MODEL, "prompt": prompt, "max_tokens": args.thinking_tokens,
        "temperature": 0.0, "stream": True, "return_token_ids": True,
        "stop_token_ids": [args.think_end_id], "skip_special_tokens": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True,
    }  # fmt: skip
    if retain:
        body["retain_kv"] = True
    start = time.perf_counter()
    ttft, text, ids, prompt_ids, usage, rid = None, [], [], None, None, None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            rid = chunk["id"]
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                if ttft is None and (choice.get("text") or choice.get("token_ids")):
                    ttft = time.perf_counter() - start
                text.append(choice.get("text") or "")
                ids += choice.get("token_ids") or []
                prompt_ids = choice.get("prompt_token_ids") or prompt_ids
    return dict(id=rid, ttft=ttft, text="".join(text), ids=ids,
                prompt_ids=prompt_ids, usage=usage)  # fmt: skip


async def stage2(client: httpx.AsyncClient, mode: str, prompt: str, s1: dict, args):
    body = {
        "model": SERVED_MODEL, "max_tokens": 3, "n": args.beam_width,
        "use_beam_search": True, "temperature": 0.0,
        "ignore_eos": True,  # a semantic ID is 3 tokens: EOS cannot end one
    }  # fmt: skip
    if mode == "text":
        body["prompt"] = prompt + s1["text"] + SUFFIX
    elif mode == "token_ids":
        body["prompt"] = s1["prompt_ids"] + s1["ids"] + args.suffix_ids
    else:
        body["continuation_of"] = s1["id"]
        body["continuation_suffix_token_ids"] = args.suffix_ids
    start = time.perf_counter()
    response = await client.post("/v1/completions", json=body)
    response.raise_for_status()
    latency = time.perf_counter() - start
    data = response.json()
    num_prompt = (
        len(body["prompt"]) if mode == "token_ids"
        else len(s1["prompt_ids"]) + len(s1["ids"]) + len(args.suffix_ids)
    )  # fmt: skip
    return latency, [c["text"] for c in data["choices"]], num_prompt


async def run_mode(url: str, mode: str, args) -> ModeResult:
    result = ModeResult(mode)
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        (await client.post("/reset_prefix_cache")).raise_for_status()
        computed0 = computed_tokens(url)
        preempt0 = metric(url, "vllm:num_preemptions_total")
        requests0 = engine_requests(url)
        semaphore = asyncio.Semaphore(args.concurrency)

        async def one(i: int) -> None:
            async with semaphore:
                prompt = user_prompt(i, args.prompt_words)
                retain = mode in ("continuation", "engine_beam")
                s1 = await stage1(client, prompt, args, retain=retain)
                usage = s1["usage"]
                cached = (usage.get("prompt_tokens_details") or {}).get(
                    "cached_tokens"
                ) or 0
                result.stage1_computed += usage["prompt_tokens"] - cached
                result.stage1_ttft.append(s1["ttft"])
                if mode == "stage1_only":
                    return
                latency, beams, num_prompt = await stage2(
                    client, mode, prompt, s1, args
                )
                result.stage2_latency.append(latency)
                result.stage2_prompt_tokens += num_prompt
                result.beams[i] = beams

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(args.requests)))
        result.wall = time.perf_counter() - start
        await asyncio.sleep(1.5)  # let the last scheduler stats reach /metrics
        result.computed_total = computed_tokens(url) - computed0
        result.preemptions = metric(url, "vllm:num_preemptions_total") - preempt0
        result.engine_requests = engine_requests(url) - requests0
    return result


def computed_tokens(url: str) -> float:
    """Prompt tokens computed so far: vLLM's count (requests the frontend
    sees), plus those of beam requests run inside the engine."""
    return metric(
        url, "vllm:prompt_tokens_by_source_total", 'source="local_compute"'
    ) + metric(url, "vllm_kvreuse:beam_computed_prompt_tokens_total")


def engine_requests(url: str) -> float:
    """Engine requests so far: those the frontend saw finish, plus the beam
    requests engine-side beam search spawned inside the engine."""
    return metric(url, "vllm:request_success_total") + metric(
        url, "vllm_kvreuse:beam_forks_total"
    )


def stage2_prompt_tokens(results: dict[str, ModeResult], args) -> float:
    return max(r.stage2_prompt_tokens for r in results.values()) / args.requests


def p99(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(0.99 * len(values)))]


def report(results: dict[str, ModeResult], args) -> None:
    pool = args.kv_blocks or "ample"
    print(
        f"\n{args.requests} two-stage requests, concurrency {args.concurrency}, "
        f"beam width {args.beam_width}, {args.thinking_tokens} thinking tokens, "
        f"KV pool: {pool} blocks of {args.block_size} tokens, "
        f"stage-2 prompt {stage2_prompt_tokens(results, args):.0f} tokens on average"
    )
    columns = ("mode", "s1 TTFT p50", "p99", "s2 lat p50", "p99",
               "s2 computed/prompt", "s2 computed/call", "s2 engine req/call",
               "preempt", "wall s", "req/s")  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for r in results.values():
        has_stage2 = bool(r.stage2_latency)
        row = (
            r.mode,
            f"{statistics.median(r.stage1_ttft) * 1e3:.0f} ms",
            f"{p99(r.stage1_ttft) * 1e3:.0f} ms",
            f"{statistics.median(r.stage2_latency) * 1e3:.0f} ms"
            if has_stage2
            else "-",
            f"{p99(r.stage2_latency) * 1e3:.0f} ms" if has_stage2 else "-",
            f"{r.stage2_computed / r.stage2_prompt_tokens:.2f}" if has_stage2 else "-",
            f"{r.stage2_computed / args.requests:.0f}" if has_stage2 else "-",
            f"{r.engine_requests / args.requests - 1:.0f}" if has_stage2 else "-",
            f"{r.preemptions:.0f}",
            f"{r.wall:.1f}",
            f"{args.requests / r.wall:.2f}",
        )
        print("| " + " | ".join(row) + " |")
    ideal = len(args.suffix_ids) + 1 + args.beam_width * 2
    print(
        f"ideal stage-2 computed tokens per call: suffix + 1 + width x 2 steps "
        f"= {ideal}; ideal engine requests: 1 + 2 x width = {1 + 2 * args.beam_width}"
        " (front end and engine alike)"
    )
    for ours in ("continuation", "engine_beam"):
        for base in ("text", "token_ids", "continuation"):
            if ours in results and base in results and base != ours:
                print_ratio(results[base], results[ours])
    if "engine_beam" in results and "stage1_only" in results:
        ratio = results["engine_beam"].wall / results["stage1_only"].wall
        print(f"(engine_beam) wall / (stage1_only) wall: {ratio:.2f}")
    check_beams(results)


def print_ratio(base: ModeResult, ours: ModeResult) -> None:
    latency = statistics.median(base.stage2_latency) / statistics.median(
        ours.stage2_latency
    )
    computed = base.stage2_computed / max(ours.stage2_computed, 1)
    print(
        f"({base.mode}) / ({ours.mode}): wall {base.wall / ours.wall:.2f}x, "
        f"stage-2 latency p50 {latency:.2f}x, stage-2 computed tokens {computed:.2f}x"
    )


def check_beams(results: dict[str, ModeResult]) -> None:
    """Stage-2 beams should not depend on how stage 2 was sent (token modes):
    identical in float32; in bfloat16 KV computed while decoding (continued)
    and KV recomputed in a prefill round differently, so near-ties may swap."""
    token_modes = [
        m for m in ("token_ids", "continuation", "engine_beam") if m in results
    ]
    base = results[token_modes[0]].beams if token_modes else {}
    for mode in token_modes[1:]:
        beams = results[mode].beams
        same = sum(beams.get(i) == want for i, want in base.items())
        print(
            f"stage-2 beams identical, ({token_modes[0]}) vs ({mode}): "
            f"{same} of {len(base)} calls"
        )


def run_on(url: str, modes: list[str], args) -> dict[str, ModeResult]:
    """Runs ``modes`` one after the other on the server at ``url``."""
    args.suffix_ids = tokenize(url, SUFFIX)
    (args.think_end_id,) = tokenize(url, "</think>")
    asyncio.run(warm_up(url, args))
    results = {}
    for mode in modes:
        results[mode] = asyncio.run(run_mode(url, mode, args))
        print(f"mode {mode}: {results[mode].wall:.1f}s", flush=True)
    return results


async def warm_up(url: str, args) -> None:
    """One two-stage request first, so no mode pays for the server's first calls."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        prompt = user_prompt(10**6, args.prompt_words)
        s1 = await stage1(client, prompt, args, retain=True)
        await stage2(client, "continuation", prompt, s1, args)


def tokenize(url: str, text: str) -> list[int]:
    body = {"model": SERVED_MODEL, "prompt": text, "add_special_tokens": False}
    return httpx.post(f"{url}/tokenize", json=body).json()["tokens"]


def server_args(args) -> list[str]:
    """The frontend modes' server; the engine modes' adds ``--engine-beam-search``."""
    server_args = [
        "--max-logprobs", str(2 * args.beam_width), "--max-model-len", "2048",
        "--max-num-batched-tokens", "4096",
        "--enable-continuation",
        "--retain-kv-max-fraction", str(args.retain_kv_max_fraction),
    ]  # fmt: skip
    if args.kv_blocks:
        server_args += ["--num-gpu-blocks-override", str(args.kv_blocks)]
    return server_args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompt-words", type=int, default=260)
    parser.add_argument("--thinking-tokens", type=int, default=128)
    parser.add_argument("--beam-width", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--kv-blocks", type=int, default=0, help="0: ample pool")
    parser.add_argument("--retain-kv-max-fraction", type=float, default=0.25)
    parser.add_argument("--modes", default=",".join(MODES))
    ServerSettings.add_arguments(parser)
    args = parser.parse_args()

    modes = args.modes.split(",")
    groups = {
        "frontend": ([], [m for m in FRONTEND_MODES if m in modes]),
        "engine": (["--engine-beam-search"], [m for m in ENGINE_MODES if m in modes]),
    }
    groups = {name: group for name, group in groups.items() if group[1]}
    settings = ServerSettings.from_args(args)
    specs = [
        ServerSpec(name, args.model, server_args(args) + extra,
                   block_size=args.block_size, settings=settings,
                   env={"VLLM_SERVER_DEV_MODE": "1"})  # for /reset_prefix_cache
        for name, (extra, _) in groups.items()
    ]  # fmt: skip
    logs = Path(tempfile.mkdtemp())
    servers = start_servers(specs, logs, args.ready_timeout)
    results: dict[str, ModeResult] = {}
    try:
        for name, (_, wanted) in groups.items():
            results |= run_on(servers[name].url, wanted, args)
    finally:
        for server in servers.values():
            server.close()
    print(f"server logs: {logs}")
    report(results, args)


if __name__ == "__main__":
    main()
