"""Where an engine step's time goes with the chunk cache on: the connector,
the hook layer and vLLM's connector plumbing, per step.

Runs the offline engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
scheduler and worker in one process, so one profile sees both sides).
Phases:

- ``unused``: random-token prompts without chunks (512 tokens, 64 out). A
  step that loads or saves no chunk should make no chunk call past the
  empty-metadata check: no per-layer call, nothing per request;
- ``rag``: ``sys##doc##doc##question`` prompts whose chunks are all stored
  (a first round, not measured, fills them), 8 tokens out: a loading step
  costs its loads (``load_chunks``, the device ops) plus bookkeeping.

Each phase prints a cProfile table (calls and cumulative microseconds per
engine step, for the functions of interest; the profiler inflates Python
calls, so read it for where and how often, not for totals) and, for
``rag``, an unprofiled split of the steps that loaded: wall time of those
steps, of the worker's loads, and of ``load_chunks`` alone.
``--mode plain`` runs the ``unused`` phase on plain vLLM for comparison.

    .venv/bin/python benchmarks/chunk_cache_step_profile.py [--mode cache|plain]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# One OpenMP thread, as vLLM gives a CPU worker on a 2-core machine: more
# threads in one process that also schedules would spin against each other.
os.environ.setdefault("OMP_NUM_THREADS", "1")

STEP = "EngineCore.step (whole step)"
RAG_PARAMS: dict[str, Any] = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
CONNECTOR = "chunk_cache/connector.py"
WORKER = "chunk_cache/worker/chunks.py"
LAYER = "vllm_kvreuse/core/layer.py"
# (file suffix, function name) -> row label, in print order.
ROWS: dict[tuple[str, str], str] = {
    ("vllm/v1/engine/core.py", "step"): STEP,
    ("vllm/v1/core/sched/scheduler.py", "schedule"): "upstream Scheduler.schedule",
    (LAYER, "schedule"): "hook layer: schedule (with upstream)",
    (LAYER, "update_from_output"): "hook layer: update_from_output (with upstream)",
    (LAYER, "_each"): "hook layer: per-step feature hooks",
    ("chunk_cache/engine/planner.py", "plan"): "scheduler side: plan (arrival)",
    (CONNECTOR, "get_num_new_matched_tokens"): "connector: get_num_new_matched_tokens",
    (CONNECTOR, "build_connector_meta"): "connector: build_connector_meta",
    (CONNECTOR, "get_kv_connector_stats"): "connector: get_kv_connector_stats",
    ("kv_connector_model_runner_mixin.py", "_get_kv_connector_output"):
        "vLLM: worker-side connector calls (context manager)",
    (CONNECTOR, "bind_connector_metadata"): "connector: bind_connector_metadata",
    (CONNECTOR, "start_load_kv"): "connector: start_load_kv",
    (CONNECTOR, "wait_for_layer_load"): "connector: wait_for_layer_load (per layer)",
    (CONNECTOR, "save_kv_layer"): "connector: save_kv_layer (per layer)",
    (CONNECTOR, "wait_for_save"): "connector: wait_for_save",
    (WORKER, "_pieces"): "worker: _pieces (one request's checks)",
    ("device/base.py", "load_chunks"): "device ops: load_chunks (one step)",
    ("device/triton_ops.py", "load_chunks"): "device ops: load_chunks (one step)",
    ("device/base.py", "load_chunk"): "device ops: load_chunk (one piece)",
    (WORKER, "_save"): "worker: _save (one chunk)",
    ("gpu_model_runner.py", "_model_forward"): "vLLM: model forward",
}  # fmt: skip


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(length)] for _ in range(count)]


def rag_requests(count: int, seed: int) -> tuple[list[Any], list[dict[str, Any]]]:
    """``count`` prompts (a system prompt, two of eight documents, a question
    of their own) and their extra_args; the documents are the same for every
    seed, their pairs, orders and the questions are not."""
    from vllm_kvreuse.chunk_cache.frontend.segments import chunked_request

    rng = random.Random(seed)
    (system,) = random_prompts(1, 64, 1000)
    documents = random_prompts(8, 200, 2000)
    prompts, extra_args = [], []
    for _ in range(count):
        question = [rng.randrange(10, 4000) for _ in range(rng.randrange(16, 32))]
        prompt, extra = chunked_request([system, *rng.sample(documents, 2), question])
        prompts.append(prompt)
        extra_args.append(extra)
    return prompts, extra_args


def profile_rows(profile: cProfile.Profile) -> dict[str, tuple[float, float]]:
    """Row label -> (calls, cumulative seconds), summed over matching functions."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    rows: dict[str, tuple[float, float]] = {}
    for (path, _, name), (_, calls, _, cumulative, _) in stats.items():
        for (suffix, function), label in ROWS.items():
            if name == function and path.endswith(suffix):
                old_calls, old_seconds = rows.get(label, (0.0, 0.0))
                rows[label] = (old_calls + calls, old_seconds + cumulative)
    return rows


def profiled(llm: Any, name: str, prompts: list[Any], params: Any) -> None:
    """Generates under cProfile; prints calls and microseconds per step."""
    profile = cProfile.Profile()
    profile.enable()
    llm.generate(prompts, params, use_tqdm=False)
    profile.disable()
    rows = profile_rows(profile)
    steps = rows[STEP][0]
    print(
        f"\n### {name}: {len(prompts)} requests, {steps:.0f} engine steps, "
        f"{rows[STEP][1] * 1e3 / steps:.2f} ms per step under cProfile\n\n"
        "| function | calls/step | us/step (cumulative, profiled) |\n|---|---|---|"
    )
    for label in dict.fromkeys(ROWS.values()):
        if label in rows:
            calls, seconds = rows[label]
            print(f"| {label} | {calls / steps:.2f} | {seconds * 1e6 / steps:.1f} |")


class Timed:
    """Wraps a bound method on its instance: calls and wall seconds."""

    def __init__(self, owner: Any, name: str) -> None:
        self.owner, self.name = owner, name
        self.original: Callable[..., Any] = getattr(owner, name)
        self.calls, self.seconds = 0, 0.0
        setattr(owner, name, self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.original(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1

    def remove(self) -> None:
        delattr(self.owner, self.name)


def timed_loads(llm: Any, rounds: list[tuple[list[Any], list[Any]]]) -> None:
    """Unprofiled, one round at a time: wall time of the steps that loaded,
    of the worker's loads, of the device ops (``load_chunks``) within them,
    and of the scheduler side's work for the round's requests (planning on
    arrival, step metadata); prints each round and the medians."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().worker_side
    core = llm.llm_engine.engine_core.engine_core
    connector = core.scheduler.connector
    step = core.step_fn
    samples: list[tuple[float, ...]] = []
    for prompts, params in rounds:
        timers = (
            Timed(worker, "_pieces"),  # a request's checks
            Timed(worker.ops, "load_chunks"),  # the step's pieces, once a step
            Timed(connector.scheduler_side, "plan"),
            Timed(connector, "build_connector_meta"),
        )
        checks, loads = timers[:2]
        loading_steps: list[float] = []

        def timed_step(loads: Timed = loads, steps: list[float] = loading_steps) -> Any:
            before, start = loads.calls, time.perf_counter()
            result = step()
            if loads.calls > before:
                steps.append(time.perf_counter() - start)
            return result

        core.step_fn = timed_step
        try:
            llm.generate(prompts, params, use_tqdm=False)
        finally:
            core.step_fn = step
            for timer in timers:
                timer.remove()
        worker_s = checks.seconds + loads.seconds
        samples.append((sum(loading_steps), worker_s, *(t.seconds for t in timers[1:])))
        print(
            f"round: {len(loading_steps)} loading step(s), {checks.calls} "
            "requests, ms: " + ", ".join(f"{v * 1e3:.2f}" for v in samples[-1])
        )
    columns = zip(*samples, strict=True)
    step_s, loads_s, ops_s, plan_s, meta_s = (statistics.median(c) for c in columns)
    print(
        f"\nUnprofiled, median of {len(samples)} rounds: the loading step(s) took "
        f"{step_s * 1e3:.2f} ms; worker loads {loads_s * 1e3:.2f} ms "
        f"({loads_s / step_s:.0%} of the step), of which load_chunks "
        f"{ops_s * 1e3:.2f} ms ({ops_s / loads_s:.0%} of the loads). Scheduler "
        f"side for the same requests: planning on arrival {plan_s * 1e3:.2f} ms, "
        f"build_connector_meta (all steps) {meta_s * 1e3:.2f} ms."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--mode", choices=("cache", "plain"), default="cache")
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # the plugin's LLM(...) keyword arguments
    llm = LLM(
        args.model, enforce_eager=True, block_size=32, dtype="float32",
        max_model_len=2048, enable_chunk_cache=args.mode == "cache",
    )  # fmt: skip
    decode = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(args.requests, 512, 0)]
    llm.generate(prompts[:4], decode, use_tqdm=False)  # warm-up
    profiled(llm, f"unused ({args.mode})", prompts[4:], decode)
    if args.mode == "cache":
        rounds = [
            (prompts, [SamplingParams(**RAG_PARAMS, extra_args=x) for x in extra])
            for prompts, extra in (rag_requests(args.requests, s) for s in range(7))
        ]
        llm.generate(*rounds[0], use_tqdm=False)  # fills every chunk
        profiled(llm, "rag, every chunk stored", *rounds[1])
        timed_loads(llm, rounds[2:])
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
