"""Several `vllm serve` processes started together, ready together.

A benchmark that compares servers (plain vLLM and ours, or three beam modes)
should not pay their start-up one after another: on a GPU each takes about
two minutes with CUDA graphs. :func:`start_servers` starts them at once and
waits for all, under one deadline.

Two things make that safe and cheap on a GPU:

- **Fixed KV sizes.** vLLM sizes its KV cache by profiling the memory left
  on the device, which assumes no neighbour allocates meanwhile. Servers
  here get ``--kv-cache-memory-bytes`` instead (:class:`ServerSettings` on a
  GPU), so nothing is profiled and neighbours cannot disturb each other.
- **One compilation per model.** Servers of one compile group (same model,
  same vLLM arguments; plugin flags do not change the compiled graph) share
  one ``torch.compile`` cache directory. The group's first server starts
  at once and compiles; the others start as soon as its log says the
  compilation is done (or after ``compile_wait`` seconds) and load the
  compiled graphs instead of compiling again. vLLM's AOT-compile cache is
  keyed by the whole config, plugin settings included, so it is turned off
  for these servers (``VLLM_USE_AOT_COMPILE=0``); its regular cache is keyed
  by the directory given. Eager servers (CPU) all start at once.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vllm_kvreuse.testing.server import Server, ServerSettings

COMPILED = re.compile(r"torch\.compile.* took [\d.]+ s in total")
"""What vLLM logs once a model's compilation is done (and saved)."""


@dataclass(frozen=True)
class ServerSpec:
    """One server of a group: ``vllm serve model_dir args...`` (see :class:`Server`)."""

    name: str
    model_dir: str
    args: Sequence[str] = ()
    block_size: int = 32
    env: Mapping[str, str] = field(default_factory=dict)
    settings: ServerSettings | None = None
    compile_group: str | None = None
    """Servers naming the same group share one compile cache; the caller
    guarantees they differ in plugin flags only."""


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
    compile_wait: float = 90,
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
    group = _Group(log_dir, compile_wait, times or StartTimes())
    deadline = group.begin + ready_timeout
    waiting = list(specs)
    try:
        while waiting or len(group.ready) < len(group.servers):
            for spec in [s for s in waiting if group.may_start(s)]:
                group.start(spec)
                waiting.remove(spec)
            for error in group.poll():
                if failures is None:
                    raise RuntimeError(error)
                failures.append(error)
            if time.monotonic() > deadline:
                late = [n for n in group.servers if n not in group.ready]
                error = f"not ready in {ready_timeout:.0f} s: " + ", ".join(
                    late + [s.name for s in waiting]
                )
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


class _Group:
    """The servers one :func:`start_servers` call has started."""

    def __init__(self, log_dir: Path, compile_wait: float, times: StartTimes) -> None:
        self.log_dir, self.compile_wait, self.times = log_dir, compile_wait, times
        self.begin = times.begin
        self.servers: dict[str, Server] = {}
        self.ready: set[str] = set()
        self.leaders: dict[str, str] = {}  # compile group -> its first server

    def may_start(self, spec: ServerSpec) -> bool:
        """Eager servers, group leaders, and followers whose leader has
        compiled (or is ready, or gone, or has had ``compile_wait``)."""
        settings = spec.settings or ServerSettings.for_tests()
        if spec.compile_group is None or settings.enforce_eager:
            return True
        leader = self.servers.get(self.leaders.get(spec.compile_group, ""))
        if spec.compile_group not in self.leaders or leader is None:
            return True
        if time.monotonic() - leader.started > self.compile_wait:
            return True
        return bool(COMPILED.search(leader.log_tail(1 << 20))) or self.is_ready(leader)

    def start(self, spec: ServerSpec) -> None:
        self.servers[spec.name] = _start(spec, self.log_dir)
        self.times.started[spec.name] = time.monotonic() - self.begin
        if spec.compile_group:
            self.leaders.setdefault(spec.compile_group, spec.name)

    @staticmethod
    def is_ready(server: Server) -> bool:
        try:
            return server.is_ready()
        except RuntimeError:
            return False

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
    settings = spec.settings or ServerSettings.for_tests()
    args = list(spec.args)
    env = dict(spec.env)
    if spec.compile_group and not settings.enforce_eager:
        cache = log_dir / "compile-cache" / spec.compile_group
        cache.mkdir(parents=True, exist_ok=True)
        args += ["--compilation-config", f'{{"cache_dir": "{cache}"}}']
        env["VLLM_USE_AOT_COMPILE"] = "0"
    return Server(
        spec.model_dir,
        *args,
        log_path=log_dir / f"{spec.name}.log",
        block_size=spec.block_size,
        env=env,
        settings=spec.settings,
        ready_timeout=None,
    )
