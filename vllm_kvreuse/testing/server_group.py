"""Several `vllm serve` processes started together, ready together.

A benchmark that compares servers (plain vLLM and ours, or three beam modes)
should not pay their start-up one after another: on a GPU each takes about
two minutes with CUDA graphs. :func:`start_servers` starts them at once and
waits for all, under one deadline.

What makes that safe on a GPU is a fixed KV size: vLLM sizes its KV cache
by profiling the memory left on the device, which assumes no neighbour
allocates meanwhile. Servers here get ``--kv-cache-memory-bytes`` instead
(:class:`ServerSettings` on a GPU), so nothing is profiled and neighbours
cannot disturb each other.

Compilation is left to vLLM's own cache, which a restarted server of the
same configuration loads instead of compiling again. Within one run the
servers of a model each compile: on an H200 six servers started at once
were ready after 125 s, of which each spent 15-22 s compiling, and about
75 s outside vLLM's engine start (imports, API server) that no cache saves;
holding the others back until the first had compiled, to load its graphs,
would have cost more than it saved.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vllm_kvreuse.testing.server import Server, ServerSettings


@dataclass(frozen=True)
class ServerSpec:
    """One server of a group: ``vllm serve model_dir args...`` (see :class:`Server`)."""

    name: str
    model_dir: str
    args: Sequence[str] = ()
    block_size: int = 32
    env: Mapping[str, str] = field(default_factory=dict)
    settings: ServerSettings | None = None


@dataclass
class StartTimes:
    """When each server of a group was started and became ready (seconds
    from the group's start)."""

    started: dict[str, float] = field(default_factory=dict)
    ready: dict[str, float] = field(default_factory=dict)
    begin: float = field(default_factory=time.monotonic)

    def summary(self) -> str:
        last = max(self.ready.values(), default=0.0)
        each = ", ".join(
            f"{name} {self.started[name]:.0f}-{self.ready[name]:.0f} s"
            for name in self.ready
        )
        return f"all ready after {last:.0f} s ({each})"


def start_servers(
    specs: Sequence[ServerSpec],
    log_dir: Path,
    ready_timeout: float = 600,
    times: StartTimes | None = None,
    failures: list[str] | None = None,
) -> dict[str, Server]:
    """Starts ``specs`` together; returns them by name once all are ready.

    Raises (after closing every server it started) if one exits, or if not
    all are ready within ``ready_timeout`` seconds; the error carries the
    log tail of each server that was not ready. Given a ``failures`` list,
    it records each such failure there instead and returns the servers that
    did get ready.
    """
    group = _Group(log_dir, times or StartTimes())
    deadline = group.begin + ready_timeout
    try:
        for spec in specs:
            group.start(spec)
        while len(group.ready) < len(group.servers):
            for error in group.poll():
                if failures is None:
                    raise RuntimeError(error)
                failures.append(error)
            if time.monotonic() > deadline:
                late = [n for n in group.servers if n not in group.ready]
                error = f"not ready in {ready_timeout:.0f} s: " + ", ".join(late)
                error += "".join(
                    f"\n--- {n}:\n{group.servers[n].log_tail(2000)}" for n in late
                )
                if failures is None:
                    raise TimeoutError(error)
                failures.append(error)
                for name in late:
                    group.servers.pop(name).close()
                break
            time.sleep(0.5)
    except BaseException:
        for server in group.servers.values():
            server.close()
        raise
    return {s.name: group.servers[s.name] for s in specs if s.name in group.servers}


@contextlib.contextmanager
def started_together(
    specs: Sequence[ServerSpec], log_dir: Path, ready_timeout: float = 600
) -> Iterator[tuple[Server, ...]]:
    """:func:`start_servers` as a context: the servers in ``specs``' order,
    all closed on leaving it."""
    started = start_servers(specs, log_dir, ready_timeout)
    try:
        yield tuple(started[spec.name] for spec in specs)
    finally:
        for server in started.values():
            server.close()


class _Group:
    """The servers one :func:`start_servers` call has started."""

    def __init__(self, log_dir: Path, times: StartTimes) -> None:
        self.log_dir, self.times = log_dir, times
        self.begin = times.begin
        self.servers: dict[str, Server] = {}
        self.ready: set[str] = set()

    def start(self, spec: ServerSpec) -> None:
        self.servers[spec.name] = _start(spec, self.log_dir)
        self.times.started[spec.name] = time.monotonic() - self.begin

    def poll(self) -> list[str]:
        """Marks servers that became ready; closes and reports those that exited."""
        errors = []
        for name, server in list(self.servers.items()):
            if name in self.ready:
                continue
            try:
                if server.is_ready():
                    self.ready.add(name)
                    self.times.ready[name] = time.monotonic() - self.begin
            except RuntimeError as exited:
                errors.append(f"{name}: {exited}")
                self.servers.pop(name).close()
        return errors


def _start(spec: ServerSpec, log_dir: Path) -> Server:
    return Server(
        spec.model_dir,
        *spec.args,
        log_path=log_dir / f"{spec.name}.log",
        block_size=spec.block_size,
        env=dict(spec.env),
        settings=spec.settings,
        ready_timeout=None,
    )
