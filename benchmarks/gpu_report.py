"""Every GPU claim of the project measured in one run: ``scripts/gpu_report.sh OUT``.

Builds the models it needs, starts every server at once (fixed KV sizes; one
compilation per model, :mod:`vllm_kvreuse.testing.server_group`), runs the
correctness tests while they start, then the measured sections one after
another, each in a process of its own, killed at its budget:

========== ======================================================== =======
section    what                                                     servers
========== ======================================================== =======
start      models built, servers started, correctness tests beside  all
rag        TTFT, plain vLLM vs chunk cache, 7B shape                 2
beams      vLLM's beam search vs engine beams vs catalog beams      3
two_stage  OpenOneRec's think-then-recommend, modes (a)-(d)          2
micro      chunk load and save vs copy bandwidth                     none
beam_steps a step of 16 beam groups by part; each step of 16 searches none
========== ======================================================== =======

``OUT/report.md`` gains each section's table as soon as it is done, so a
run cut short still reports what finished; ``OUT/results.json`` holds the
figures and the summary checks them against the targets. Logs:
``servers.log``, ``correctness.log``, ``sections.log``, ``models.log``.

``--dry-run`` runs every section on the CPU with the tiny model and small
sizes (the test suite does, so the report cannot rot): with no budgets, a
smaller correctness selection, and the correctness tests before the servers
start rather than beside them, so its outcome never depends on the
machine's speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the benchmarks beside it

import gpu_report_correctness as correctness
from gpu_report_plan import Plan
from gpu_report_summary import STEPS, summary

from vllm_kvreuse.testing.server import Server
from vllm_kvreuse.testing.server_group import StartTimes, start_servers

ROOT = Path(__file__).resolve().parents[1]
LOG_BYTES = 2 << 20  # of each server's log, the last 2 MiB go to servers.log


class Report:
    """``report.md`` and ``results.json`` in ``out``, written as they grow."""

    def __init__(self, out: Path, begin: float) -> None:
        self.out, self.begin = out, begin
        self.results: dict = {}
        self.markdown = out / "report.md"
        self.markdown.write_text("# vllm-kvreuse GPU report\n")

    def section(self, title: str, body: str, result: dict | None = None) -> None:
        elapsed = time.monotonic() - self.begin
        with open(self.markdown, "a") as md:
            md.write(f"\n## {title}\n\n{body.rstrip()}\n\n_done at {elapsed:.0f} s_\n")
        if result is not None:
            self.results[title] = result
            (self.out / "results.json").write_text(json.dumps(self.results, indent=1))
        print(f"[report] {title} done at {elapsed:.0f} s", flush=True)


def run_section(
    name: str, config: dict, budget: float | None, log: Path
) -> tuple[str, dict | None]:
    """One section's process: (its Markdown, its result or None), killed at
    ``budget`` seconds (None: never) with what it printed kept."""
    cmd = [
        sys.executable,
        str(Path(__file__).parent / "gpu_report_sections.py"),
        name,
        json.dumps(config),
    ]
    env = {**os.environ, "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
    start = time.monotonic()
    with open(log, "a") as err:
        err.write(f"\n==== section {name}\n")
        err.flush()
        try:
            done = subprocess.run(
                cmd,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                timeout=budget,
                env=env,
            )
            text, note = (
                done.stdout,
                f"exit {done.returncode}" if done.returncode else "",
            )
        except subprocess.TimeoutExpired as expired:
            out = expired.stdout
            text = out.decode(errors="replace") if isinstance(out, bytes) else out or ""
            note = f"cut at its budget of {budget:.0f} s"
    # A section reports figures on lines of their own, as soon as it has
    # them (a section cut at its budget keeps those it reported).
    result: dict | None = None
    lines = []
    for line in text.splitlines():
        if line.startswith("RESULT "):
            result = {**(result or {}), **json.loads(line[len("RESULT ") :])}
        else:
            lines.append(line)
    seconds = time.monotonic() - start
    of = f" of a {budget:.0f} s budget" if budget is not None else ""
    footer = f"\n\n({seconds:.0f} s{of}{'; ' + note if note else ''})"
    return "\n".join(lines) + footer, result


def build_models(plan: Plan, log: Path) -> dict[str, threading.Thread]:
    """Builds each model the plan needs that is not there yet, in the
    background; returns a thread per model directory."""
    threads = {}
    for directory, preset in plan.models.items():
        if (ROOT / directory / "config.json").exists():
            continue
        cmd = [
            sys.executable,
            "-m",
            "vllm_kvreuse.testing.tiny_model",
            directory,
            "--preset",
            preset,
        ]

        def build(cmd=cmd) -> None:
            with open(log, "a") as out:
                subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)

        threads[directory] = threading.Thread(target=build, daemon=True)
        threads[directory].start()
    return threads


def start_all(
    plan: Plan, models: dict[str, threading.Thread], logs: Path, times: StartTimes
) -> tuple[dict[str, Server], list[str]]:
    """Starts each model's servers once the model is built, all together.
    Returns the servers that started and what went wrong with the others."""
    servers: dict[str, Server] = {}
    errors: list[str] = []

    def start(directory: str) -> None:
        if directory in models:
            models[directory].join()
        specs = [s for s in plan.servers() if s.model_dir == directory]
        if not specs:
            return
        servers.update(
            start_servers(specs, logs, plan.ready_timeout, times=times, failures=errors)
        )

    threads = [threading.Thread(target=start, args=(d,)) for d in plan.models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return servers, errors


def copy_server_logs(logs: Path, out: Path) -> None:
    with open(out / "servers.log", "w") as dest:
        for log in sorted(logs.glob("*.log")):
            data = log.read_bytes()[-LOG_BYTES:]
            dest.write(f"\n==== {log.stem}\n{data.decode(errors='replace')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="where report.md and its logs go")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU, tiny model, small sizes (what the tests run)",
    )
    args = parser.parse_args()
    begin = time.monotonic()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(ROOT)
    # Server logs, compile caches, the catalog: outside OUT (at most 8 files).
    plan = Plan.make(args.dry_run, Path(tempfile.mkdtemp(prefix="gpu-report-")))
    report = Report(out, begin)
    log = out / "sections.log"
    models = build_models(plan, out / "models.log")
    device: list[tuple[str, dict | None]] = []
    describing = threading.Thread(
        target=lambda: device.append(
            run_section("env", {}, None if args.dry_run else 60, out / "env.log")
        )
    )
    describing.start()
    for directory in plan.test_models:  # the tests and the store sizing need it
        if directory in models:
            models[directory].join()
    plan.size_store()

    # Servers start (each once its model is built) while the tests run; in
    # a dry run after them, so a small machine never runs both at once.
    times = StartTimes()
    started: list[tuple[dict[str, Server], list[str]]] = []
    starting = threading.Thread(
        target=lambda: started.append(start_all(plan, models, plan.logs, times))
    )
    if not args.dry_run:
        starting.start()
    describing.join()
    report.section("Device and software", *device[0])
    results = correctness.run(
        sys.executable,
        out / "correctness.log",
        plan.budgets.get("correctness"),
        gpu=not args.dry_run,
        junit_dir=plan.work,
    )
    report.section(
        "Correctness",
        correctness.markdown(results),
        {r.file: dict(r.outcomes) for r in results},
    )
    if args.dry_run:
        starting.start()
    starting.join()
    servers, errors = started[0]
    copy_server_logs(plan.logs, out)
    failures = "".join(f"\n\n**Not started**: {e}" for e in errors)
    report.section("Start-up", plan.describe(times, servers) + failures, times.ready)
    try:
        for name, title in plan.measured:
            try:
                config = plan.config(name, servers)
            except KeyError as missing:
                report.section(title, f"Not run: server {missing} did not start.")
                continue
            report.section(
                title, *run_section(name, config, plan.budget(name, begin), log)
            )
    finally:
        copy_server_logs(plan.logs, out)
        for server in servers.values():
            server.close()
    text, result = run_section(
        "micro", plan.config("micro", {}), plan.budget("micro", begin), log
    )
    report.section("Chunk load against copy bandwidth", text, result)
    budget = plan.budget("beam_steps", begin)
    text, result = run_section("beam_steps", plan.config("beam_steps", {}), budget, log)
    report.section(STEPS, text, result)
    report.section("Summary", summary(report.results, time.monotonic() - begin, plan))


if __name__ == "__main__":
    main()
