"""Samples a live server while the soak runs: /metrics, /health and memory.

One :class:`Sample` every ``interval`` seconds, so that progress (or the lack
of it) over time is visible: queue lengths, KV usage, token counters,
preemptions, the memory of the server's processes (the API server and its
children: the engine core, and vLLM's helpers).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import psutil

_SAMPLE = re.compile(r"^(vllm[:_][A-Za-z0-9_:]+)(\{[^}]*\})? (\S+)$", re.MULTILINE)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → ``{name or name{labels}: value}``; a name alone is
    the sum over its series."""
    values: dict[str, float] = {}
    for name, labels, value in _SAMPLE.findall(text):
        number = float(value)
        values[name] = values.get(name, 0.0) + number
        if labels:
            values[name + labels] = number
    return values


def labelled(metrics: dict[str, float], name: str, label: str) -> dict[str, float]:
    """``{label value: metric value}`` over the series of ``name``."""
    pattern = re.compile(rf'{re.escape(label)}="([^"]*)"')
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key.startswith(name + "{") and (match := pattern.search(key)):
            out[match.group(1)] = out.get(match.group(1), 0.0) + value
    return out


@dataclass(frozen=True, slots=True)
class Memory:
    """Resident set sizes in bytes: the API server, and all its children."""

    api_server: int
    children: int

    @property
    def total(self) -> int:
        return self.api_server + self.children


def server_memory(pid: int) -> Memory | None:
    """RSS of ``pid`` and of its descendants; None once it is gone."""
    try:
        root = psutil.Process(pid)
        api = root.memory_info().rss
        children = 0
        for child in root.children(recursive=True):
            try:
                children += child.memory_info().rss
            except psutil.Error:
                continue  # exited between listing and reading
        return Memory(api, children)
    except psutil.Error:
        return None


@dataclass(frozen=True, slots=True)
class Sample:
    """The server at one moment (``t``: seconds since the load started)."""

    t: float
    health: int | None  # /health status; None: no answer
    outstanding: int  # client requests in flight
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    preemptions: float | None = None
    waiting_by_reason: dict[str, float] = field(default_factory=dict)
    kv_fetch_by_stage: dict[str, float] = field(default_factory=dict)
    memory: Memory | None = None

    @property
    def tokens(self) -> float | None:
        if self.prompt_tokens is None or self.generation_tokens is None:
            return None
        return self.prompt_tokens + self.generation_tokens


async def take_sample(
    client: httpx.AsyncClient, pid: int, t: float, outstanding: int
) -> Sample:
    """One sample; fields the server did not answer stay None."""
    try:
        health: int | None = (await client.get("/health", timeout=5)).status_code
    except httpx.HTTPError:
        health = None
    try:
        metrics = parse_metrics((await client.get("/metrics", timeout=5)).text)
    except httpx.HTTPError:
        metrics = {}
    return Sample(
        t=t,
        health=health,
        outstanding=outstanding,
        running=metrics.get("vllm:num_requests_running"),
        waiting=metrics.get("vllm:num_requests_waiting"),
        kv_usage=metrics.get("vllm:kv_cache_usage_perc"),
        prompt_tokens=metrics.get("vllm:prompt_tokens_total"),
        generation_tokens=metrics.get("vllm:generation_tokens_total"),
        preemptions=metrics.get("vllm:num_preemptions_total"),
        waiting_by_reason=labelled(
            metrics, "vllm:num_requests_waiting_by_reason", "reason"
        ),
        kv_fetch_by_stage=labelled(
            metrics, "vllm:num_requests_kv_fetch_by_stage", "stage"
        ),
        memory=server_memory(pid),
    )


class Sampler:
    """Takes a sample every ``interval`` seconds until stopped."""

    def __init__(
        self,
        url: str,
        pid: int,
        t0: float,
        outstanding: Callable[[], int],
        interval: float = 2.0,
    ) -> None:
        self.url = url
        self.pid = pid
        self.t0 = t0
        self.outstanding = outstanding
        self.interval = interval
        self.samples: list[Sample] = []
        self._stop = asyncio.Event()

    async def run(self) -> None:
        # Its own client: a pool saturated by the load must not delay it.
        async with httpx.AsyncClient(base_url=self.url) as client:
            while not self._stop.is_set():
                await self.sample(client)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.interval)

    async def sample(self, client: httpx.AsyncClient) -> Sample:
        sample = await take_sample(
            client, self.pid, time.monotonic() - self.t0, self.outstanding()
        )
        self.samples.append(sample)
        return sample

    def stop(self) -> None:
        self._stop.set()
