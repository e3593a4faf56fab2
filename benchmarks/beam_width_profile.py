"""Where a wide beam search's time goes: one offline search, profiled.

Runs an in-process engine (engine core in this process, so ``cProfile``
sees the scheduler, the beam step and the worker), times ``--repeats``
searches of one fresh prompt each at every ``--widths``, then profiles one
search at the widest and prints the top functions by cumulative and by own
time.

    .venv/bin/python benchmarks/beam_width_profile.py           # tiny, engine beams
    .venv/bin/python benchmarks/beam_width_profile.py --plain   # vLLM's own loop
    .venv/bin/python benchmarks/beam_width_profile.py --compare --top 0
    .venv/bin/python benchmarks/beam_width_profile.py --sampling --top 0 --widths 512

``--sampling`` also times ``n = width`` sampling of the same length on the
same engine (what a user compares a beam search with) and prints beams / n.
``--searches K`` runs K searches (and K samplings) at once, each on its own
prompt: ``--searches 16 --widths 50`` is 16 concurrent searches of width 50.
``--step-times`` prints each engine step's wall time of one more search.
``--paired N`` (with ``--sampling``) then times N pairs, a search and a
sampling back to back, and prints the median of their ratios: a busy box's
drift between the two blocks of repeats cancels.
``--step-parts`` prints, per engine step of a search, the medians over the
timed searches of its parts: ``schedule`` (``Scheduler.schedule``),
``execute`` (the runner's ``execute_model``: its input preparation and the
forward), ``sample`` (its ``sample_tokens``: the sampler or the beam step),
``update`` (``Scheduler.update_from_output`` and the features' hooks in it)
and the step whole.
``--gc`` prints the time Python's collector took during the timed searches
(``gc.callbacks``), per search.

``--compare`` also times, in the same engine, the previous design of engine
beam search (a new one-token request per beam per step, which the engine
still uses where members cannot live) and prints live / per-step ratios.
``max_num_seqs`` is set to the widest width: members live only when the
whole width fits the running seats.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=3)
    parser.add_argument("--dtype", default="float32", help="bfloat16 on a GPU")
    parser.add_argument(
        "--kv-cache-mib",
        type=int,
        default=None,
        help="the engine's KV cache (default: vLLM's sizing, on a CPU most of "
        "the memory, which takes about 20 s to allocate)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--searches",
        type=int,
        default=1,
        help="searches (and n = width samplings) run at once, each its own prompt",
    )
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--plain", action="store_true", help="vLLM's own beam search")
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="beams never end at EOS (semantic-ID stage 2): rows of W, not 2 x W",
    )
    parser.add_argument(
        "--sampling",
        action="store_true",
        help="also time n = width sampling of the same length (same engine)",
    )
    parser.add_argument(
        "--step-times",
        action="store_true",
        help="print each engine step's wall time in the last timed search",
    )
    parser.add_argument(
        "--paired",
        type=int,
        default=0,
        help="with --sampling: also this many pairs, a search then a sampling "
        "each, and the median of their ratios (drift cancels)",
    )
    parser.add_argument(
        "--step-parts",
        action="store_true",
        help="print each engine step's parts (medians over the timed searches)",
    )
    parser.add_argument(
        "--gc",
        action="store_true",
        help="print the garbage collector's time per timed search",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also time per-step member requests (the design before live beams)",
    )
    args = parser.parse_args()

    import vllm_kvreuse

    vllm_kvreuse.register()
    from vllm import LLM
    from vllm.sampling_params import BeamSearchParams, SamplingParams

    llm = LLM(
        args.model, dtype=args.dtype, enforce_eager=True,
        max_model_len=args.prompt_tokens + args.max_tokens + 32,
        max_logprobs=2 * max(args.widths) + 1,
        max_num_seqs=max(256, *(w * args.searches for w in args.widths)),
        max_num_batched_tokens=max(8192, *(w * args.searches for w in args.widths)),
        engine_beam_search=not args.plain,
        kv_cache_memory_bytes=args.kv_cache_mib and args.kv_cache_mib << 20,
    )  # fmt: skip
    beam = None
    if not args.plain:
        core = llm.llm_engine.engine_core.engine_core
        beam = core.scheduler.feature("beam")
    numbers = iter(range(10**9))

    def fresh_prompt() -> list[int]:
        rng = random.Random(next(numbers))
        return [rng.randrange(10, 600) for _ in range(args.prompt_tokens)]

    def prompts() -> list[dict]:
        return [{"prompt_token_ids": fresh_prompt()} for _ in range(args.searches)]

    engine_step = llm.llm_engine.step
    step_ms: list[float] = []
    parts = StepParts(llm.llm_engine.engine_core.engine_core)

    def timed_step() -> object:
        start = time.perf_counter()
        try:
            return engine_step()
        finally:
            step_ms.append((time.perf_counter() - start) * 1e3)
            parts.step_done(step_ms[-1])

    llm.llm_engine.step = timed_step

    def search(width: int) -> float:
        step_ms.clear()
        batch = prompts()
        params = BeamSearchParams(
            beam_width=width, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos
        )
        start = time.perf_counter()
        llm.beam_search(batch, params, concurrency_limit=args.searches)
        return time.perf_counter() - start

    def sample(width: int) -> float:
        batch = prompts()
        params = SamplingParams(
            n=width, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos
        )
        start = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - start

    mode = "vLLM's beam search" if args.plain else "engine beam search"
    rows = "ignore_eos" if args.ignore_eos else "EOS ends beams"
    print(
        f"{mode}, {args.model}, {args.prompt_tokens}-token prompts, {rows}, "
        f"{args.searches} at once"
    )

    def per_step(on: bool) -> None:
        # Benchmark-only switch: the feature's own check, answered "no".
        if on:
            beam._can_live = lambda group: False  # type: ignore[union-attr]
        else:
            vars(beam).pop("_can_live", None)

    collector = Collector()
    for width in args.widths:
        search(width)  # warm-up
        collector.start(args.gc)
        parts.on = args.step_parts
        times = []
        for _ in range(args.repeats):
            times.append(search(width))
            parts.search_done()
        parts.on = False
        gc_ms = collector.stop() / args.repeats
        live = statistics.median(times)
        line = f"width {width}: {live * 1e3:.0f} ms (median)"
        if args.gc:
            line += f"; collector {gc_ms:.1f} ms a search"
        if args.compare and beam is not None:
            per_step(True)
            search(width)
            old = statistics.median(search(width) for _ in range(args.repeats))
            per_step(False)
            line += f"; per-step members {old * 1e3:.0f} ms; {old / live:.2f}x"
        if args.sampling:
            sample(width)  # warm-up
            collector.start(args.gc)
            n = statistics.median([sample(width) for _ in range(args.repeats)])
            gc_ms = collector.stop() / args.repeats
            line += f"; n = {width} sampling {n * 1e3:.0f} ms"
            if args.gc:
                line += f" (collector {gc_ms:.1f} ms)"
            line += f"; beams / n {live / n:.2f}"
        print(line)
        if args.sampling and args.paired:
            ratios = sorted(search(width) / sample(width) for _ in range(args.paired))
            print(
                f"  paired: beams / n {statistics.median(ratios):.2f} (median of "
                f"{len(ratios)} pairs, each a search then a sampling; "
                f"{ratios[0]:.2f}-{ratios[-1]:.2f})"
            )
        if args.step_parts:
            print(parts.table())
        if args.step_times:
            search(width)
            steps = ", ".join(f"{ms:.0f}" for ms in step_ms)
            print(f"  engine steps of one search, ms: {steps} (sum {sum(step_ms):.0f})")
    if not args.top:
        return

    profile = cProfile.Profile()
    profile.enable()
    search(max(args.widths))
    profile.disable()
    stats = pstats.Stats(profile)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(args.top)


class StepParts:
    """Times the parts of each engine step (``--step-parts``) while ``on``.

    Wraps the in-process engine core's scheduler and executor methods on
    their instances (this benchmark's engine only)."""

    PARTS = {
        "schedule": ("scheduler", "schedule"),
        "execute": ("model_executor", "execute_model"),
        "sample": ("model_executor", "sample_tokens"),
        "update": ("scheduler", "update_from_output"),
    }

    def __init__(self, core: object) -> None:
        self.on = False
        self._step: dict[str, float] = {}
        self._search: list[dict[str, float]] = []
        self._searches: list[list[dict[str, float]]] = []
        for part, (owner, method) in self.PARTS.items():
            target = getattr(core, owner)
            setattr(target, method, self._timed(part, getattr(target, method)))

    def _timed(self, part: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                ms = (time.perf_counter() - start) * 1e3
                self._step[part] = self._step.get(part, 0.0) + ms

        return timed

    def step_done(self, whole_ms: float) -> None:
        if self.on:
            self._search.append({**self._step, "step": whole_ms})
        self._step = {}

    def search_done(self) -> None:
        if self.on:
            self._searches.append(self._search)
        self._search = []

    def table(self) -> str:
        """Per step index, each part's median over the searches (ms)."""
        searches, self._searches = self._searches, []
        columns = [*self.PARTS, "step"]
        lines = ["| step | " + " | ".join(columns) + " |"]
        lines.append("|---:|" + "---:|" * len(columns))
        for i in range(max(map(len, searches), default=0)):
            steps = [s[i] for s in searches if i < len(s)]
            cells = [
                f"{statistics.median(s.get(c, 0.0) for s in steps):.1f}"
                for c in columns
            ]
            lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


class Collector:
    """Times Python's garbage collections while started."""

    def __init__(self) -> None:
        self.ms = 0.0
        self._began = 0.0

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.ms += (time.perf_counter() - self._began) * 1e3

    def start(self, on: bool) -> None:
        self.ms = 0.0
        if on:
            gc.callbacks.append(self._on)

    def stop(self) -> float:
        """The collections' milliseconds since :meth:`start`."""
        if self._on in gc.callbacks:
            gc.callbacks.remove(self._on)
        return self.ms


if __name__ == "__main__":
    main()
