"""Engine steps per generated token of a lone beam search, sync and async.

vLLM's CPU platform turns async scheduling off ("not required on CPU");
both runners run with it, so this turns it back on in its engine (the
platform's config hook, overridden here only) and counts the engine's
``schedule()`` calls, and the ones that ran the group's members, for one
search. Prints one line per scheduling mode and the final beams (the same
in both).

    .venv/bin/python benchmarks/beam_async_steps.py --runner v1
    .venv/bin/python benchmarks/beam_async_steps.py --runner v2 --width 4 --tokens 12
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, os.path.dirname(__file__))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--runner", choices=("v1", "v2"), default="v1")
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--async-scheduling", choices=("on", "off"), default="on")
    args = parser.parse_args()
    if args.runner == "v2":
        from beam_step_overhead import use_v2_runner

        use_v2_runner()
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__
    on = args.async_scheduling == "on"

    def check_and_update_config(cls, vllm_config) -> None:  # type: ignore[no-untyped-def]
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = on

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign]

    import vllm_kvreuse

    vllm_kvreuse.register()
    from vllm import LLM
    from vllm.sampling_params import BeamSearchParams

    llm = LLM(
        args.model, enforce_eager=True, block_size=32, dtype="float32",
        max_model_len=512, engine_beam_search=True, kv_cache_memory_bytes=256 << 20,
    )  # fmt: skip
    core = llm.llm_engine.engine_core.engine_core
    scheduler = core.scheduler
    members: list[int] = []
    schedule = scheduler.schedule

    def counted(*a, **k):  # type: ignore[no-untyped-def]
        output = schedule(*a, **k)
        members.append(sum("-beam" in r for r in output.num_scheduled_tokens))
        return output

    scheduler.schedule = counted
    prompt = [(7 * i) % 3000 + 60 for i in range(40)]
    params = BeamSearchParams(
        beam_width=args.width, max_tokens=args.tokens, ignore_eos=True
    )
    (out,) = llm.beam_search([{"prompt_token_ids": prompt}], params)
    ran = [i + 1 for i, n in enumerate(members) if n]
    per_token = (ran[-1] - ran[0] + 1) / len(ran)
    print(
        f"runner {args.runner}, async scheduling {core.async_scheduling}: "
        f"{len(members)} schedules; members ran in {len(ran)} "
        f"(steps {ran[0]}-{ran[-1]}): {per_token:.2f} steps per member token"
    )
    for seq in out.sequences:
        print(seq.tokens[len(prompt) :], round(seq.cum_logprob, 4))


if __name__ == "__main__":
    main()
