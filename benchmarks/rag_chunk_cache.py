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

Both servers start together (:mod:`vllm_kvreuse.testing.server_group`).
Prints TTFT median and p90 per phase and server, the ratio plain / chunk
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

from vllm_kvreuse.testing.server import SERVED_MODEL, ServerSettings, metric
from vllm_kvreuse.testing.server_group import ServerSpec, StartTimes, start_servers

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
    ``recompute``: a ``chunk_recompute`` value, or a dict of body fields)."""
    key = "chunks" if isinstance(prompt, list) else "prompt"
    body = {"model": SERVED_MODEL, key: prompt, "max_tokens": 1}
    if isinstance(recompute, dict):
        body.update(recompute)
    elif recompute is not None:
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

    from vllm_kvreuse.chunk_cache.worker.rope import model_rope
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


def chunk_lookups(url: str) -> tuple[float, float]:
    """The chunk store's (hits, misses) counters so far."""
    return (
        metric(url, "vllm_kvreuse:chunk_cache_hits_total"),
        metric(url, "vllm_kvreuse:chunk_cache_misses_total"),
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def phase_prompts(args: argparse.Namespace) -> dict[str, list[list[str]]]:
    """Each phase's prompts as segments (system prompt, documents, question):
    cold (every document new), warm (every document seen, in new orders and
    company), mixed (half and half). ``args``: docs_per_prompt, doc_words,
    requests."""
    rng = random.Random(0)
    k = args.docs_per_prompt
    pool = [document(n, args.doc_words) for n in range(2 * args.requests * k + k)]
    fresh = iter(range(len(pool)))
    seen: list[int] = []

    def prompt_set(new_per_prompt: int) -> list[list[str]]:
        out = []
        for i in range(args.requests):
            docs = [next(fresh) for _ in range(new_per_prompt)]
            docs += rng.sample(seen, k - new_per_prompt) if k > new_per_prompt else []
            rng.shuffle(docs)
            seen.extend(docs[:new_per_prompt])
            out.append([rng.choice(SYSTEMS), *(pool[d] for d in docs), question(i)])
        return out

    phases = {"cold": prompt_set(k)}
    phases["warm"] = prompt_set(0)
    phases["mixed"] = prompt_set(k // 2)
    return phases


def stored_documents(args: argparse.Namespace) -> int:
    """How many documents a run stores (the chunk store should hold them)."""
    k = args.docs_per_prompt
    return args.requests * (k + k // 2)


def row(name: str, plain: list[float], chunk: list[float], **rates: float) -> dict:
    """One table row: TTFT p50 and p90 of both servers (seconds) and rates."""
    p50 = statistics.median(plain) if plain else float("nan")
    c50 = statistics.median(chunk)
    return {
        "phase": name,
        "plain p50": p50,
        "plain p90": percentile(plain, 0.9) if plain else float("nan"),
        "chunk p50": c50,
        "chunk p90": percentile(chunk, 0.9),
        "ratio": p50 / c50,
        **rates,
    }


def measure(
    plain_url: str,
    chunk_url: str,
    phases: dict[str, list[list[str]]],
    args: argparse.Namespace,
) -> list[dict]:
    """The phases on both servers (plain vLLM gets each prompt as one text),
    and after the warm one its references (:func:`warm_references`). Rows
    of :func:`row`, printed by :func:`markdown`."""
    run_phase(plain_url, ["warm up the server now?"], 1)  # not in any phase
    run_phase(chunk_url, [["warm up", "the server", "now?"]], 1)
    rows = []
    for name, segment_lists in phases.items():
        plain = run_phase(
            plain_url, ["".join(s) for s in segment_lists], args.concurrency
        )
        looked_up = chunk_lookups(chunk_url)
        chunk = run_phase(chunk_url, segment_lists, args.concurrency)
        after = chunk_lookups(chunk_url)
        hits, misses = (b - a for a, b in zip(looked_up, after, strict=True))
        cached = sum(r[2] for r in chunk) / sum(r[1] for r in chunk)
        rows.append(
            row(name, [r[0] for r in plain], [r[0] for r in chunk],
                hit_rate=hits / (hits + misses) if hits + misses else 0.0,
                cached_share=cached)
        )  # fmt: skip
        if name == "warm":
            plain_times = [r[0] for r in plain]
            rows += warm_references(
                plain_url, chunk_url, segment_lists, plain_times, args
            )
    return rows


def warm_references(
    plain_url: str,
    chunk_url: str,
    warm: list[list[str]],
    plain_times: list[float],
    args: argparse.Namespace,
) -> list[dict]:
    """Right after the warm phase (whose plain vLLM TTFTs are
    ``plain_times``): the warm prompts on the chunk server with each
    ``args.warm_recompute`` value, and again on plain vLLM, where every one
    is now a full prefix hit (the reuse limit)."""
    rows = []
    for value in map(json.loads, args.warm_recompute):
        times = run_phase(chunk_url, warm, args.concurrency, value)
        name = f"warm, chunk_recompute={json.dumps(value)}"
        rows.append(row(name, plain_times, [r[0] for r in times]))
    for attention in args.warm_attention:
        # Documents seen in this mode first (its paths' prefixes cached), then
        # timed in a new order with a new question.
        fields = {"chunk_attention": attention}
        run_phase(chunk_url, warm, args.concurrency, fields)
        times = run_phase(chunk_url, reordered(warm), args.concurrency, fields)
        name = f"warm, chunk_attention={attention} (primed, new order)"
        rows.append(row(name, plain_times, [r[0] for r in times]))
    repeat = run_phase(plain_url, ["".join(s) for s in warm], args.concurrency)
    hit_share = sum(r[2] for r in repeat) / sum(r[1] for r in repeat)
    name = "warm, plain again (a full prefix hit; in the chunk columns)"
    rows.append(row(name, plain_times, [r[0] for r in repeat], cached_share=hit_share))
    return rows


def reordered(prompts: list[list[str]]) -> list[list[str]]:
    """Each prompt's documents in another order, its question asked anew."""
    rng = random.Random(1)
    out = []
    for system, *docs, asked in prompts:
        docs = docs[1:] + docs[:1] if len(docs) > 1 else docs
        rng.shuffle(docs)
        out.append([system, *docs, asked.replace("Question", "Asked again:")])
    return out


def markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table (times in ms; ratio = plain / chunk p50)."""
    lines = [
        "| phase | plain TTFT p50 | plain p90 | chunk TTFT p50 | chunk p90 "
        "| plain / chunk (p50) | chunk hit rate | cached share |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ms = [f"{r[k] * 1e3:.0f} ms" for k in ("plain p50", "plain p90")]
        ms += [f"{r[k] * 1e3:.0f} ms" for k in ("chunk p50", "chunk p90")]
        rates = [f"{r[k]:.2f}" if k in r else "" for k in ("hit_rate", "cached_share")]
        lines.append(
            f"| {r['phase']} | {' | '.join(ms)} | {r['ratio']:.2f}x | "
            + " | ".join(rates) + " |"
        )  # fmt: skip
    return "\n".join(lines).replace("nan ms", "")


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
    parser.add_argument(
        "--warm-attention", nargs="*", default=[],
        help="then, for each chunk_attention value (paths, choose), the warm "
        "prompts once in that mode, and timed again in a new order with new "
        "questions, one row each",
    )  # fmt: skip
    ServerSettings.add_arguments(parser)
    args = parser.parse_args()
    settings = ServerSettings.from_args(args)
    phases = phase_prompts(args)
    common = ["--max-model-len", str(args.max_model_len)]
    common += ["--max-num-batched-tokens", str(args.max_model_len)]
    specs = [
        ServerSpec("plain", args.model, common, settings=settings),
        ServerSpec("chunk", args.model, [*common, "--enable-chunk-cache"],
                   settings=settings),
    ]  # fmt: skip
    logs = Path(tempfile.mkdtemp())
    times = StartTimes()
    servers = start_servers(specs, logs, args.ready_timeout, times=times)
    try:
        print(
            f"model {args.model}, {args.docs_per_prompt} documents of "
            f"~{args.doc_words} words, {args.requests} requests per phase, "
            f"concurrency {args.concurrency}; servers: {times.summary()}"
        )
        rows = measure(servers["plain"].url, servers["chunk"].url, phases, args)
    finally:
        for server in servers.values():
            server.close()
    print(markdown(rows))
    warm = next(r for r in rows if r["phase"] == "warm")
    hit = next(r for r in rows if r["phase"].startswith("warm, plain again"))
    limit = warm["chunk p50"] / hit["chunk p50"]
    print(f"\nchunk warm / full prefix hit: {limit:.2f}x")
    cold = rows[0]
    rerotate = rerotate_copy_ms_per_1k(args.model)
    print(
        f"re-rotation + copy: {rerotate:.1f} ms per 1K tokens (all layers); "
        f"plain cold TTFT p50: {cold['plain p50'] * 1e3:.0f} ms"
    )


if __name__ == "__main__":
    main()
