"""What a cache-threshold rejection costs next to serving the request.

One `vllm serve` with the plugin; for each of N fresh (cold) prompts it sends
the same request twice, in alternation:
- rejected: ``cache_hit_threshold: 0.5`` (the prompt is cold, so it is turned
  back with finish_reason "cache_threshold" before any KV block is allocated);
- served: ``cache_hit_threshold: 0`` (what plain vLLM does: prefill, then the
  first token), timed to its first streamed token (TTFT).
Both are client round trips over loopback, so HTTP overhead is in both.

    .venv/bin/python benchmarks/cache_threshold_rejection.py [--model DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from vllm_kvreuse.testing.server import SERVED_MODEL, Server, ServerSettings


def prompt(i: int, words: int) -> str:
    return f"Prompt {i}: " + " ".join(
        f"doc{(i * 131 + j) % 4001}" for j in range(words)
    )


def timed_stream(client: httpx.Client, body: dict) -> tuple[float, str]:
    """Seconds to the first chunk that carries text or a finish reason."""
    start = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = httpx.Response(200, content=line[6:]).json()["choices"][0]
            if choice["text"] or choice["finish_reason"]:
                return time.perf_counter() - start, choice["finish_reason"] or "token"
    raise RuntimeError("stream ended without output")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--prompt-words", type=int, default=400)
    ServerSettings.add_arguments(parser)
    args = parser.parse_args()
    settings = ServerSettings.from_args(args)

    log = Path(tempfile.mkdtemp()) / "server.log"
    with Server(
        args.model,
        "--max-model-len",
        "4096",
        "--global-cache-hit-threshold",
        "0",
        log_path=log,
        settings=settings,
    ) as server:
        client = httpx.Client(base_url=server.url, timeout=300)
        base = {"model": SERVED_MODEL, "max_tokens": 1, "stream": True}
        timed_stream(client, {**base, "prompt": "warm up", "cache_hit_threshold": 0})
        rejected, served = [], []
        for i in range(args.requests):
            # Distinct prompts for the two arms, so neither warms the other.
            t, reason = timed_stream(
                client, {**base, "prompt": prompt(2 * i, args.prompt_words),
                         "cache_hit_threshold": 0.5},
            )  # fmt: skip
            assert reason == "cache_threshold", reason
            rejected.append(t)
            t, reason = timed_stream(
                client, {**base, "prompt": prompt(2 * i + 1, args.prompt_words),
                         "cache_hit_threshold": 0},
            )  # fmt: skip
            assert reason != "cache_threshold", reason
            served.append(t)
        kv_usage = server.metric("vllm:kv_cache_usage_perc")
        rejections = server.metric("vllm_kvreuse:cache_threshold_rejections_total")
        tokenized = client.post(
            "/tokenize",
            json={"model": SERVED_MODEL, "prompt": prompt(0, args.prompt_words)},
        )
        num_prompt_tokens = tokenized.json()["count"]

    reject_ms = statistics.median(rejected) * 1e3
    ttft_ms = statistics.median(served) * 1e3
    print(f"model {args.model}, {args.requests} requests per arm, "
          f"{num_prompt_tokens} prompt tokens each")  # fmt: skip
    print(f"rejection round trip  p50 {reject_ms:8.2f} ms")
    print(f"served request TTFT   p50 {ttft_ms:8.2f} ms")
    print(f"ratio TTFT / rejection    {ttft_ms / reject_ms:8.1f}x")
    print(f"rejections counted in /metrics: {rejections:.0f}")
    print(f"KV cache usage at idle: {kv_usage}")


if __name__ == "__main__":
    main()
