"""RAG over a corpus: a Zipf-popular stream of documents against the chunk
store's tiers and plain vLLM given the same memory, one server at a time.

A corpus of ``--docs`` documents of ``--doc-tokens`` tokens (natural-ish
text in the served model's tokenizer), drawn for each request by Zipf
popularity (exponent ``--zipf``), ``--docs-per-request`` of them after one
of three system prompts, with a question of its own; ``--clients`` clients
send the stream for ``--duration`` seconds, each request timed to its first
token (``max_tokens`` 1). Every mode gets the same stream:

- ``plain``: plain vLLM, the prompt as one text; its KV cache is the chunk
  server's plus the chunk store's device and CPU tiers (same total memory);
- ``chunk``: ``--enable-chunk-cache`` with its defaults (device and CPU
  tiers), the prompt as ``chunks``;
- ``chunk:none``: the same, each request with ``chunk_recompute: "none"``
  (what the store alone gives, without the default's recomputed tokens);
- ``chunk+disk``: ``chunk`` with a disk tier (``--disk-gib``) that holds
  the corpus;
- ``chunk:choose`` (or ``chunk:paths``): ``chunk``, each request in that
  answer mode (``chunk_attention``): its paths' ``system + document``
  prefixes load from the store's tiers when vLLM's prefix cache no longer
  holds them (not in the default ``--modes``).

The ideal hit rate is computed from the stream: a segment (system prompt or
document) counts as an ideal hit when an earlier request of the stream had
it. Reported for the whole stream and for its second half (requests started
after half the duration): requests per second, TTFT p50 and p99, the hit
rate per tier against the ideal, the cached share of prompt tokens, and the
server's memory (RSS of its processes) at the end.

    .venv/bin/python benchmarks/rag_corpus.py                     # SmolLM2, 1000 docs
    .venv/bin/python benchmarks/rag_corpus.py --modes chunk --duration 60
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from vllm_kvreuse.testing.processes import descendants
from vllm_kvreuse.testing.server import SERVED_MODEL, Server, ServerSettings, metric

WORD_TEXT = """
time year people way day man thing woman life child world school state
family student group country problem hand part place case week company
system program question work government number night point home water
room mother area money story fact month lot right study book eye job
word business issue side kind head house service friend father power
hour game line end member law car city community name president team
minute idea kid body information back parent face others level office
door health person art war history party result change morning reason
research girl guy moment air teacher force education river harbor
engine bridge valley market garden winter summer island forest station
museum library theory
"""
WORDS = tuple(WORD_TEXT.split())
TIERS = ("device", "cpu", "disk", "remote")
GIB = 2**30


@dataclass
class Record:
    number: int  # in the stream
    started: float  # seconds into the run
    ttft: float
    prompt_tokens: int
    cached_tokens: int


@dataclass
class Run:
    """One mode's stream: its records and the server's counters at the
    start, at half time and at the end."""

    mode: str
    records: list[Record] = field(default_factory=list)
    counters: list[dict[str, float]] = field(default_factory=list)
    ideal: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Request -> (segments an earlier request had, segments)."""
    rss_gib: float = 0.0


def corpus(args: argparse.Namespace, tokenizer) -> list[str]:
    """``args.docs`` documents, each about a size drawn from ``args.doc_tokens``."""
    rng = random.Random(args.seed)
    low, high = args.doc_tokens
    per_word = len(tokenizer(" ".join(WORDS))["input_ids"]) / len(WORDS)
    documents = []
    for number in range(args.docs):
        words = round(rng.randint(low, high) / per_word)
        body = " ".join(rng.choice(WORDS) for _ in range(words))
        documents.append(f"Document {number}. {body.capitalize()}.\n")
    return documents


def stream(args: argparse.Namespace, count: int) -> list[tuple[int, list[int]]]:
    """(system prompt, documents) of each request, Zipf-popular documents."""
    rng = random.Random(args.seed + 1)
    weights = [1 / (rank + 1) ** args.zipf for rank in range(args.docs)]
    order = list(range(args.docs))
    rng.shuffle(order)  # popularity rank -> document
    requests = []
    for _ in range(count):
        k = rng.randint(*args.docs_per_request)
        chosen: list[int] = []
        while len(chosen) < k:
            (doc,) = rng.choices(order, weights)
            if doc not in chosen:
                chosen.append(doc)
        requests.append((rng.randrange(3), chosen))
    return requests


def systems() -> list[str]:
    return [
        f"You are assistant {n}. Answer from the documents only.\n" * 3
        for n in range(3)
    ]


def counters(url: str) -> dict[str, float]:
    names = ["hits", "misses", *(f"{tier}_hits" for tier in TIERS)]
    return {n: metric(url, f"vllm_kvreuse:chunk_cache_{n}_total") for n in names}


def rss_gib(server: Server) -> float:
    total = 0
    for pid in [server.process.pid, *descendants(server.process.pid)]:
        try:
            fields = Path(f"/proc/{pid}/statm").read_text().split()
            total += int(fields[1]) * 4096
        except OSError:
            continue
    return total / GIB


def run_stream(server: Server, mode: str, docs: list[str], args) -> Run:
    """Sends the stream for ``args.duration`` seconds from ``args.clients``."""
    run = Run(mode)
    trace = stream(args, 100_000)
    system_texts = systems()
    seen: set[tuple[str, int]] = set()
    lock = threading.Lock()
    next_request = iter(range(len(trace)))
    begin = time.monotonic()
    half_taken = threading.Event()

    def client() -> None:
        with httpx.Client(base_url=server.url, timeout=600) as http:
            while time.monotonic() - begin < args.duration:
                with lock:
                    number = next(next_request)
                    system, chosen = trace[number]
                    keys = [("system", system)] + [("doc", d) for d in chosen]
                    run.ideal[number] = (sum(k in seen for k in keys), len(keys))
                    seen.update(keys)
                    if (
                        not half_taken.is_set()
                        and time.monotonic() - begin >= args.duration / 2
                    ):
                        half_taken.set()
                        if mode != "plain":
                            run.counters.append(counters(server.url))
                segments = [
                    system_texts[system],
                    *(docs[d] for d in chosen),
                    f"Question {number}: which document names a harbor?",
                ]
                body = {"model": SERVED_MODEL, "max_tokens": 1}
                if mode == "plain":
                    body["prompt"] = "".join(segments)
                else:
                    body["chunks"] = segments
                if mode == "chunk:none":
                    body["chunk_recompute"] = "none"
                elif mode in ("chunk:choose", "chunk:paths"):
                    body["chunk_attention"] = mode.partition(":")[2]
                started = time.monotonic()
                response = http.post("/v1/completions", json=body)
                elapsed = time.monotonic() - started
                response.raise_for_status()
                usage = response.json()["usage"]
                cached = (usage.get("prompt_tokens_details") or {}).get(
                    "cached_tokens"
                ) or 0
                with lock:
                    run.records.append(
                        Record(
                            number,
                            started - begin,
                            elapsed,
                            usage["prompt_tokens"],
                            cached,
                        )
                    )

    if mode != "plain":
        run.counters.append(counters(server.url))
    with ThreadPoolExecutor(args.clients) as pool:
        for future in [pool.submit(client) for _ in range(args.clients)]:
            future.result()
    if mode != "plain":
        time.sleep(1.5)  # the last steps' stats reach /metrics
        run.counters.append(counters(server.url))
    run.rss_gib = rss_gib(server)
    return run


def rows(run: Run, args) -> list[str]:
    """The run's table rows: the whole stream, then its second half."""
    out = []
    for name, first_index, since in (
        ("whole", 0, 0.0),
        ("second half", 1, args.duration / 2),
    ):
        records = [r for r in run.records if r.started >= since]
        hits = sum(run.ideal[r.number][0] for r in records)
        lookups = sum(run.ideal[r.number][1] for r in records)
        ideal = hits / max(lookups, 1)
        ttfts = sorted(r.ttft for r in records)
        prompt = max(sum(r.prompt_tokens for r in records), 1)
        cells = [
            run.mode,
            name,
            str(len(records)),
            f"{len(records) / (args.duration - since):.2f}",
            f"{statistics.median(ttfts) * 1e3:.0f} ms",
            f"{ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] * 1e3:.0f} ms",
            f"{ideal:.2f}",
            f"{sum(r.cached_tokens for r in records) / prompt:.2f}",
        ]
        cells += tier_cells(run, first_index, ideal)
        cells.append(f"{run.rss_gib:.1f}")
        out.append("| " + " | ".join(cells) + " |")
    return out


def tier_cells(run: Run, first_index: int, ideal: float) -> list[str]:
    """Hit rate (and its share of the ideal), then per tier, from the
    server's counters since ``run.counters[first_index]``."""
    if len(run.counters) < 3:
        return ["-"] * 4
    first, end = run.counters[first_index], run.counters[-1]
    looked = max(end["hits"] - first["hits"] + end["misses"] - first["misses"], 1)
    rate = (end["hits"] - first["hits"]) / looked
    cells = [f"{rate:.2f} ({rate / max(ideal, 1e-9):.0%})"]
    for tier in TIERS[:3]:
        cells.append(f"{(end[f'{tier}_hits'] - first[f'{tier}_hits']) / looked:.2f}")
    return cells


def server_for(mode: str, args, settings: ServerSettings, logs: Path) -> Server:
    from vllm_kvreuse.chunk_cache.engine.tiers import cpu_tier_bytes

    kv_gib: float = args.kv_gib
    flags = ["--max-model-len", "8192", "--max-num-batched-tokens", "8192"]
    if mode == "plain":  # the chunk store's device and CPU tiers, as KV cache
        kv_gib += args.kv_gib * 0.1 + cpu_tier_bytes("auto") / GIB
    else:
        flags.append("--enable-chunk-cache")
    if mode == "chunk+disk":
        flags += [
            "--chunk-cache-disk-path",
            str(logs / "disk"),
            "--chunk-cache-disk-gib",
            str(args.disk_gib),
        ]
    # whole GiB on CPU: plain vLLM gets the next one up (never less memory)
    env = {"VLLM_CPU_KVCACHE_SPACE": str(math.ceil(kv_gib))}
    return Server(
        args.model,
        *flags,
        log_path=logs / f"{mode}.log",
        env=env,
        settings=settings,
        ready_timeout=args.ready_timeout,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/smollm2")
    parser.add_argument("--docs", type=int, default=1000)
    parser.add_argument("--doc-tokens", type=int, nargs=2, default=[200, 500])
    parser.add_argument("--docs-per-request", type=int, nargs=2, default=[4, 8])
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--duration", type=float, default=150)
    parser.add_argument(
        "--kv-gib",
        type=int,
        default=2,
        help="the chunk servers' KV cache (CPU: VLLM_CPU_KVCACHE_SPACE)",
    )
    parser.add_argument("--disk-gib", type=float, default=32)
    parser.add_argument("--modes", default="plain,chunk,chunk:none,chunk+disk")
    parser.add_argument("--seed", type=int, default=0)
    ServerSettings.add_arguments(parser)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    documents = corpus(args, AutoTokenizer.from_pretrained(args.model))
    settings = ServerSettings.from_args(args)
    logs = Path(tempfile.mkdtemp())
    runs = []
    for mode in args.modes.split(","):
        with server_for(mode, args, settings, logs) as server:
            runs.append(run_stream(server, mode, documents, args))
        print(
            f"{mode}: {len(runs[-1].records)} requests; log {logs / (mode + '.log')}",
            flush=True,
        )
    low, high = args.docs_per_request
    print(
        f"\n{args.docs} documents of {args.doc_tokens[0]}-{args.doc_tokens[1]} "
        f"tokens, Zipf {args.zipf}, {low}-{high} a request, {args.clients} "
        f"clients, {args.duration:.0f} s a mode, model {args.model}\n"
    )
    print(
        "| mode | part | requests | req/s | TTFT p50 | TTFT p99 | ideal hit rate "
        "| cached share | hit rate (of ideal) | device | CPU | disk | RSS GiB |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for run in runs:
        print("\n".join(rows(run, args)))


if __name__ == "__main__":
    main()
