"""RAG prompts on plain vLLM and on the chunk cache, side by side in one run.

Two `vllm serve` processes of the same model: plain vLLM (prefix caching on,
the prompt sent as one text without separators) and `--enable-chunk-cache`
(the same text sent as its segments, ``chunks``: system prompt, documents,
question).
Documents come from a pool, in shuffled order, after one of several system
prompts, with varying questions, sent by several concurrent clients.

Phases, each timed to the first token (max_tokens 1, non-streaming):
- cold: every document is new to both servers;
- warm: every document was seen before, in other orders/positions;
- mixed: half the documents seen, half new;
- prefix hit (reference): the warm phase's prompts sent again, unchanged,
  to plain vLLM: a full prefix-cache hit, where only the last partial block
  is computed. It is the reuse limit the chunk cache's warm TTFT is
  compared with (``warm / prefix hit``).

Prints TTFT median and p99 per phase and server, the ratio plain / chunk
cache, and for the chunk server two rates that answer different questions:
- chunk hit rate: chunks found in the chunk store / chunks looked up in the
  phase (the store's ``vllm_kvreuse:chunk_cache_{hits,misses}`` counters);
- cached share: prompt tokens not computed / prompt tokens (the responses'
  ``cached_tokens``): chunks loaded from the store plus prefix-cache hits.
  The question is always computed, and so is a chunk new to this very
  request (computed in place), so it stays below 1 even when every chunk is
  a hit.

    .venv/bin/python benchmarks/rag_chunk_cache.py [--model DIR] [--doc-words N]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from vllm_kvreuse.testing.server import SERVED_MODEL, Server, ServerSettings

SYSTEMS = [f"System {n}: answer briefly from the documents. " * 4 for n in range(3)]


def document(number: int, words: int) -> str:
    rng = random.Random(number)
    return f"Document {number}. " + " ".join(
        f"w{rng.randrange(3000)}" for _ in range(words)
    )


def question(number: int) -> str:
    return f"Question {number}: what does the document say about w{number}?"


def ask(
    client: httpx.Client, prompt: str | list[str], recompute: Any = None
) -> tuple[float, int, int]:
    """(seconds to the first token, prompt tokens, cached prompt tokens) of a
    text prompt, or of a list of segments sent as ``chunks`` (with
    ``chunk_recompute`` when ``recompute`` is given)."""
    key = "chunks" if isinstance(prompt, list) else "prompt"
    body = {"model": SERVED_MODEL, key: prompt, "max_tokens": 1}
    if recompute is not None:
        body["chunk_recompute"] = recompute
    start = time.perf_counter()
    response = client.post("/v1/completions", json=body)
    elapsed = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"{response.status_code}: {response.text}")
    usage = response.json()["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return elapsed, usage["prompt_tokens"], details.get("cached_tokens") or 0


def run_phase(
    url: str,
    prompts: list[str] | list[list[str]],
    concurrency: int,
    recompute: Any = None,
):
    with (
        httpx.Client(base_url=url, timeout=600) as client,
        ThreadPoolExecutor(concurrency) as pool,
    ):
        return list(pool.map(lambda p: ask(client, p, recompute), prompts))


def rerotate_copy_ms_per_1k(model: str, repeats: int = 5) -> float:
    """Milliseconds to re-rotate and copy 1,024 chunk tokens into a paged KV
    cache, all layers, with the plugin's own ops (float32, CPU layout)."""
    import torch
    from vllm.config import ModelConfig, VllmConfig

    from vllm_kvreuse.chunk_cache.rope import model_rope
    from vllm_kvreuse.device.layouts import cpu_attn_views
    from vllm_kvreuse.device.torch_ops import TorchOps

    config = ModelConfig(model, max_model_len=4096)
    rope = model_rope(VllmConfig(model_config=config))
    text = config.hf_text_config
    heads, layers = text.num_key_value_heads, text.num_hidden_layers
    tokens, block = 1024, 32
    caches = [
        cpu_attn_views(
            torch.zeros(tokens // block, heads, block, 2 * rope.head_size), block, "vec"
        )
        for _ in range(layers)
    ]
    ops = TorchOps(caches, rope)
    stored = torch.randn(layers, 2, tokens, heads, rope.head_size)
    block_ids = torch.arange(tokens // block)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        ops.load_chunk(block_ids, 0, stored, 0, tokens, 1000)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def chunk_lookups(server: Server) -> tuple[float, float]:
    """The chunk store's (hits, misses) counters so far."""
    return (
        server.metric("vllm_kvreuse:chunk_cache_hits_total"),
        server.metric("vllm_kvreuse:chunk_cache_misses_total"),
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--docs-per-prompt", type=int, default=4)
    parser.add_argument("--doc-words", type=int, default=300)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument(
        "--warm-recompute", nargs="*", default=['"none"'],
        help="after the phases, the warm prompts again on the chunk server "
        "with each of these chunk_recompute values (JSON), one row each",
    )  # fmt: skip
    ServerSettings.add_arguments(parser)
    args = parser.parse_args()
    settings = ServerSettings.from_args(args)

    rng = random.Random(0)
    k = args.docs_per_prompt
    pool = [document(n, args.doc_words) for n in range(2 * args.requests * k + k)]
    fresh = iter(range(len(pool)))
    seen: list[int] = []

    def prompt_set(new_per_prompt: int) -> list[tuple[str, list[str]]]:
        out = []
        for i in range(args.requests):
            docs = [next(fresh) for _ in range(new_per_prompt)]
            docs += rng.sample(seen, k - new_per_prompt) if k > new_per_prompt else []
            rng.shuffle(docs)
            seen.extend(docs[:new_per_prompt])
            segments = [rng.choice(SYSTEMS), *(pool[d] for d in docs), question(i)]
            out.append(segments)
        return out

    phases = {"cold": prompt_set(k)}
    phases["warm"] = prompt_set(0)
    phases["mixed"] = prompt_set(k // 2)

    logs = Path(tempfile.mkdtemp())
    common = ["--max-model-len", str(args.max_model_len)]
    common += ["--max-num-batched-tokens", str(args.max_model_len)]
    with (
        Server(
            args.model, *common, log_path=logs / "plain.log", settings=settings
        ) as plain,
        Server(
            args.model,
            *common,
            "--enable-chunk-cache",
            log_path=logs / "chunk.log",
            settings=settings,
        ) as chunked,
    ):
        # warm-up, not in any phase
        run_phase(plain.url, ["warm up the server now?"], 1)
        run_phase(chunked.url, [["warm up", "the server", "now?"]], 1)
        print(
            f"model {args.model}, {k} documents of ~{args.doc_words} words, "
            f"{args.requests} requests per phase, concurrency {args.concurrency}"
        )
        print(
            "| phase | plain TTFT p50 | plain p99 | chunk TTFT p50 | chunk p99 "
            "| p50 ratio | chunk hit rate | cached share |"
        )
        print("|---|---|---|---|---|---|---|---|")
        cold_prefill_ms_per_1k = 0.0
        warm_chunk_p50 = plain_warm = 0.0
        for name, segment_lists in phases.items():
            plain_results = run_phase(
                plain.url, ["".join(s) for s in segment_lists], args.concurrency
            )
            looked_up = chunk_lookups(chunked)
            chunk_results = run_phase(chunked.url, segment_lists, args.concurrency)
            after = chunk_lookups(chunked)
            hits, misses = (b - a for a, b in zip(looked_up, after, strict=True))
            p_times = [r[0] for r in plain_results]
            c_times = [r[0] for r in chunk_results]
            cached = sum(r[2] for r in chunk_results) / sum(r[1] for r in chunk_results)
            chunk_hit_rate = hits / (hits + misses) if hits + misses else 0.0
            if name == "cold":
                cold_prefill_ms_per_1k = statistics.median(
                    r[0] * 1e3 / r[1] * 1024 for r in plain_results
                )
            if name == "warm":
                warm_chunk_p50 = statistics.median(c_times)
                plain_warm = statistics.median(p_times)
            print(
                f"| {name} | {statistics.median(p_times) * 1e3:.0f} ms "
                f"| {percentile(p_times, 0.99) * 1e3:.0f} ms "
                f"| {statistics.median(c_times) * 1e3:.0f} ms "
                f"| {percentile(c_times, 0.99) * 1e3:.0f} ms "
                f"| {statistics.median(p_times) / statistics.median(c_times):.2f}x "
                f"| {chunk_hit_rate:.2f} | {cached:.2f} |"
            )
        for value in map(json.loads, args.warm_recompute):
            times = [
                r[0]
                for r in run_phase(chunked.url, phases["warm"], args.concurrency, value)
            ]
            print(
                f"| warm, chunk_recompute={json.dumps(value)} | "
                f"{plain_warm * 1e3:.0f} ms | | {statistics.median(times) * 1e3:.0f}"
                f" ms | {percentile(times, 0.99) * 1e3:.0f} ms | "
                f"{plain_warm / statistics.median(times):.2f}x | | |"
            )
        # The reuse limit: the warm prompts again, as one text, on plain vLLM.
        repeat = run_phase(
            plain.url, ["".join(s) for s in phases["warm"]], args.concurrency
        )
        hit_times = [r[0] for r in repeat]
        hit_share = sum(r[2] for r in repeat) / sum(r[1] for r in repeat)
        print(
            f"\nfull prefix hit (plain, warm prompts again): TTFT p50 "
            f"{statistics.median(hit_times) * 1e3:.0f} ms, p99 "
            f"{percentile(hit_times, 0.99) * 1e3:.0f} ms, cached share "
            f"{hit_share:.2f}; chunk warm / prefix hit: "
            f"{warm_chunk_p50 / statistics.median(hit_times):.2f}x"
        )
    rerotate = rerotate_copy_ms_per_1k(args.model)
    print(
        f"re-rotation + copy: {rerotate:.1f} ms per 1K tokens (all layers); "
        f"plain cold prefill: {cold_prefill_ms_per_1k:.0f} ms per 1K tokens "
        f"({rerotate / cold_prefill_ms_per_1k:.1%} of it)"
    )


if __name__ == "__main__":
    main()
