"""What a soak found: per-kind counts and latencies, failures, stalls, the
drain, memory growth, the server log's errors; and the same as markdown."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from vllm_kvreuse.testing.soak.monitor import Memory, Sample
from vllm_kvreuse.testing.soak.records import Record
from vllm_kvreuse.testing.soak.run import SoakResult

MIB = 2**20


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass(frozen=True, slots=True)
class KindStats:
    kind: str
    count: int
    statuses: dict[str, int]  # "200": n, ..., "none": no answer
    p50: float
    p95: float
    max: float
    not_ok: int


def kind_stats(records: list[Record]) -> list[KindStats]:
    by_kind: dict[str, list[Record]] = {}
    for record in records:
        by_kind.setdefault(record.kind, []).append(record)
    out = []
    for kind in sorted(by_kind):
        group = by_kind[kind]
        latencies = [r.latency for r in group]
        statuses = Counter(str(r.status) if r.status else "none" for r in group)
        out.append(
            KindStats(
                kind, len(group), dict(sorted(statuses.items())),
                percentile(latencies, 0.5), percentile(latencies, 0.95),
                max(latencies), sum(not r.ok for r in group),
            )
        )  # fmt: skip
    return out


def max_stall(samples: list[Sample]) -> tuple[float, float]:
    """Longest time (seconds, and when it began) with client requests in
    flight and vLLM's prompt + generation token counters standing still."""
    longest, began = 0.0, 0.0
    last_progress: float | None = None
    previous: Sample | None = None
    for sample in samples:
        tokens = sample.tokens
        if tokens is None:
            continue  # no /metrics answer: neither progress nor proof of none
        moved = previous is None or tokens > (previous.tokens or 0.0)
        if moved or not sample.outstanding:
            last_progress = sample.t
        elif last_progress is not None and sample.t - last_progress > longest:
            longest, began = sample.t - last_progress, last_progress
        previous = sample
    return longest, began


@dataclass(frozen=True, slots=True)
class LogFindings:
    num_tracebacks: int
    error_lines: list[str]  # first distinct ERROR lines
    last_stats_line: str | None


def scan_log(path: Path, max_lines: int = 8) -> LogFindings:
    text = path.read_text(errors="replace") if path.exists() else ""
    # vLLM's shutdown kills the engine core at once: errors after it are noise.
    text = text.split("[shutdown]", 1)[0]
    errors: list[str] = []
    for line in text.splitlines():
        if " ERROR " in line or "Error:" in line:
            line = re.sub(r"^\S+ \S+ \S+ ", "", line.strip())[:240]
            if line not in errors:
                errors.append(line)
    stats = [line for line in text.splitlines() if "Running:" in line]
    return LogFindings(
        text.count("Traceback"),
        errors[:max_lines],
        stats[-1].strip()[:400] if stats else None,
    )


@dataclass(slots=True)
class Summary:
    result: SoakResult
    kinds: list[KindStats]
    errors_5xx: list[Record]
    timeouts: list[Record]
    not_ok: list[Record]
    slowest: Record | None
    health_failures: int
    stall: tuple[float, float]
    memory_baseline: Memory | None
    memory_peak: Memory | None
    memory_end: Memory | None
    log: LogFindings | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def memory_growth(self) -> int | None:
        """None when unknown, or meaningless: a server that died shrank."""
        if (
            self.memory_baseline is None
            or self.memory_end is None
            or not self.result.alive
        ):
            return None
        return self.memory_end.total - self.memory_baseline.total


def summarize(result: SoakResult, log_path: Path | None = None) -> Summary:
    records = result.records + result.probes
    memories = [(s.t, s.memory) for s in result.samples if s.memory is not None]
    # The first half warms up: allocator pools, vLLM's caches, the chunk
    # store's fixed tier filling, the continuation registry (which keeps each
    # finished request addressable for --retain-kv-ttl, 60 s by default).
    baseline = next(
        (m for t, m in memories if t >= result.config.duration / 2),
        memories[0][1] if memories else None,
    )
    return Summary(
        result=result,
        kinds=kind_stats(records),
        errors_5xx=[r for r in records if r.is_5xx],
        timeouts=[r for r in records if r.timed_out],
        not_ok=[r for r in records if not r.ok],
        slowest=max(records, key=lambda r: r.latency, default=None),
        health_failures=sum(s.health != 200 for s in result.samples),
        stall=max_stall(result.samples),
        memory_baseline=baseline,
        memory_peak=max((m for _, m in memories), key=lambda m: m.total, default=None),
        memory_end=memories[-1][1] if memories else None,
        log=scan_log(log_path) if log_path is not None else None,
    )


def _mib(memory: Memory | None) -> str:
    if memory is None:
        return "-"
    return f"{memory.total / MIB:.0f} MiB (API {memory.api_server / MIB:.0f})"


def _num(value: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def headline(summary: Summary) -> list[tuple[str, str]]:
    result = summary.result
    last = result.drain.last or Sample(t=0.0, health=None, outstanding=0)
    growth = summary.memory_growth
    limit = result.config.request_timeout
    probes = ", ".join(
        f"{p.status or 'no answer'} in {p.latency:.1f} s" for p in result.probes
    )
    memory = " → ".join(
        _mib(m)
        for m in (summary.memory_baseline, summary.memory_peak, summary.memory_end)
    )
    return [
        ("requests", f"{len(result.records)} in {result.load_seconds:.0f} s"),
        ("5xx", str(len(summary.errors_5xx))),
        (f"timeouts (> {limit:.0f} s)", str(len(summary.timeouts))),
        ("not as expected", str(len(summary.not_ok))),
        ("slowest", summary.slowest.describe() if summary.slowest else "-"),
        ("/health not 200", f"{summary.health_failures} of {len(result.samples)}"),
        (
            "longest stall (requests in flight, no new tokens)",
            f"{summary.stall[0]:.0f} s from t={summary.stall[1]:.0f} s",
        ),
        (
            "KV usage after drain",
            f"{_num(last.kv_usage, '{:.1%}')} after {result.drain.seconds:.0f} s "
            f"(running {_num(last.running)}, waiting {_num(last.waiting)})",
        ),
        ("probes (plain, RAG)", probes),
        ("memory mid-load → peak → end", memory),
        (
            "memory growth from mid-load to the end",
            "-" if growth is None else f"{growth / MIB:+.0f} MiB",
        ),
        ("server alive at the end", str(result.alive)),
    ]


def timeline(samples: list[Sample], max_rows: int = 40) -> list[str]:
    step = max(1, -(-len(samples) // max_rows))
    rows = [
        "| t s | in flight | running | waiting | KV fetch in progress | KV usage "
        "| tokens/s | preemptions | RSS MiB | health |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i in range(0, len(samples), step):
        s, prev = samples[i], samples[i - step] if i >= step else None
        rate = None
        if prev is not None and s.tokens is not None and prev.tokens is not None:
            rate = (s.tokens - prev.tokens) / max(s.t - prev.t, 1e-9)
        rows.append(
            f"| {s.t:.0f} | {s.outstanding} | {_num(s.running)} | {_num(s.waiting)} "
            f"| {_num(s.kv_fetch_by_stage.get('in_progress'))} "
            f"| {_num(s.kv_usage, '{:.1%}')} | {_num(rate)} | {_num(s.preemptions)} "
            f"| {_num(s.memory.total / MIB if s.memory else None)} | {s.health} |"
        )
    return rows


def to_markdown(summary: Summary, command: str | None = None) -> str:
    result = summary.result
    config = result.config
    lines = [
        f"### {config.duration:.0f} s at concurrency {config.concurrency}, "
        f"seed {config.seed}",
        "",
    ]
    if command:
        lines += ["```bash", command, "```", ""]
    lines += [f"Server flags: `{' '.join(result.server_args)}`", ""]
    lines += ["| | |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in headline(summary)]
    lines += ["", "| kind | n | statuses | p50 s | p95 s | max s | not as expected |"]
    lines += ["|---|---|---|---|---|---|---|"]
    for k in summary.kinds:
        statuses = ", ".join(f"{s}: {n}" for s, n in k.statuses.items())
        lines.append(
            f"| {k.kind} | {k.count} | {statuses} | {k.p50:.2f} | {k.p95:.2f} "
            f"| {k.max:.2f} | {k.not_ok} |"
        )
    if summary.not_ok:
        lines += ["", "Requests not as expected (first 25):", ""]
        lines += [f"- {r.describe()}" for r in summary.not_ok[:25]]
    lines += ["", "Timeline:", "", *timeline(result.samples)]
    if summary.log is not None:
        log = summary.log
        lines += ["", f"Server log: {log.num_tracebacks} tracebacks."]
        if log.last_stats_line:
            lines += ["Last stats line:", "", "```", log.last_stats_line, "```"]
        if log.error_lines:
            lines += ["First error lines:", "", "```", *log.error_lines, "```"]
    return "\n".join(lines) + "\n"
