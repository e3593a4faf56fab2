"""A warm chunked request's prefill in one engine step against one step a
recomputed span, on the offline engine (no server, no HTTP: what is left
is the engine's own work).

Each round sends a new prompt of four new documents (first sight: stored),
then the same documents in another order with a new question, three ways:
the default recompute, ``chunk_recompute: "none"``, and the default prompt
again (a plain prefix hit, the limit of reuse); and, for scale, a plain
prompt of that length computing as many tokens as the default did after a
prefix hit (the compute no step count removes). Prints TTFT p50 of each
and the engine steps each prefill took (``kvreuse_prefill_steps``).

``--seats 1`` leaves no runner row to lend, so the default runs one step a
recomputed span (what every warm request did before the one-step prefill);
without it the default runs in one step. Both in one run::

    .venv/bin/python benchmarks/chunk_one_step.py --both

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``);
each ``--seats`` value in a process of its own (one chunk-cache engine a
process).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def measure(args: argparse.Namespace) -> dict[str, tuple[float, int]]:
    """Mode -> (TTFT p50 in ms, prefill steps of its last request)."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm import LLM, SamplingParams

    from vllm_kvreuse.core.request_keys import CHUNKS, seal

    llm = LLM(
        args.model, enforce_eager=True, dtype="float32", max_model_len=8192,
        max_num_batched_tokens=8192, max_num_seqs=args.seats,
        enable_chunk_cache=True,
    )  # fmt: skip
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(300, 4000) for _ in range(n)]

    computed: list[int] = []  # each chunked request's computed tokens

    def run(segments: list[list[int]], recompute: str | None) -> tuple[float, int]:
        """TTFT and prefill steps of a chunked prompt (one segment: plain)."""
        extra_args = None
        if len(segments) > 1:
            extra_args = seal({CHUNKS: [len(s) for s in segments[:-1]]})
        if recompute is not None:
            extra_args = {**(extra_args or {}), "chunk_recompute": recompute}
        params = SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra_args)
        prompt = {"prompt_token_ids": [t for s in segments for t in s]}
        start = time.perf_counter()
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        if recompute is None and len(segments) > 1:
            computed.append(len(prompt["prompt_token_ids"]) - out.num_cached_tokens)
        steps = (out.kv_transfer_params or {}).get("kvreuse_prefill_steps", 1)
        return seconds, steps

    system = tokens(40)
    modes = ("default", "none", "prefix hit", "plain, as many tokens computed")
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    steps: dict[str, int] = {}
    for round_ in range(args.rounds + 1):
        docs = [tokens(args.doc_tokens) for _ in range(4)]
        run([system, *docs, tokens(12)], None)  # first sight: stored
        warm = [system, *reversed(docs), tokens(12)]  # every document moved
        timed = {}
        llm.reset_prefix_cache()  # the chunks stay stored
        timed["default"] = run(warm, None)
        recomputed = computed[-1]  # the default's computed tokens
        timed["prefix hit"] = run(warm, None)
        llm.reset_prefix_cache()
        timed["none"] = run(warm, "none")
        # The default's computed tokens alone: a plain prompt of the same
        # length whose prefix cache holds all but as many tokens.
        plain = tokens(sum(map(len, warm)))
        run([plain[: len(plain) - recomputed]], None)
        timed[modes[3]] = run([plain], None)
        for mode, (seconds, steps[mode]) in timed.items():
            if round_:  # the first round warms the engine up
                times[mode].append(seconds)
    return {m: (statistics.median(t) * 1e3, steps[m]) for m, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--doc-tokens", type=int, default=420)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seats", type=int, default=8)
    parser.add_argument("--both", action="store_true")
    args = parser.parse_args()
    if args.both:
        print("| prefill | mode | TTFT p50 | / none | steps |")
        print("|---|---|---:|---:|---:|")
        for seats in (1, 8):
            argv = [a for a in sys.argv[1:] if a != "--both"]
            cmd = [sys.executable, __file__, *argv, "--seats", str(seats)]
            subprocess.run(cmd, check=True)
        return
    result = measure(args)
    label = "one step" if args.seats > 1 else "one step a span (1 seat)"
    none = result["none"][0]
    for mode, (ms, steps) in result.items():
        print(f"| {label} | {mode} | {ms:.1f} ms | {ms / none:.2f}x | {steps} |")


if __name__ == "__main__":
    main()
