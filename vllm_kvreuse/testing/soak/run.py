"""One soak: the mix for a bounded time, then the drain and the probes.

1. ``concurrency`` workers send the mix (:mod:`.mix`) for ``duration``
   seconds while a sampler (:mod:`.monitor`) polls the server; a worker
   finishes the request it is in, bounded by the per-request limit.
2. Drain: the soak waits until the server holds no KV block and queues no
   request. Retained parents live at most :data:`~.mix.MAX_TTL` seconds, so
   a pool that is still in use ``MAX_TTL`` plus a few steps later has leaked.
3. Probes: one plain and one RAG request on the quiet server, which must
   both answer (the issue saw the RAG one hang), then the pool must be
   empty again.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from vllm_kvreuse.testing.server import Server
from vllm_kvreuse.testing.soak.corpus import Corpus
from vllm_kvreuse.testing.soak.mix import MALFORMED, MAX_TTL, Mix
from vllm_kvreuse.testing.soak.monitor import Sample, Sampler
from vllm_kvreuse.testing.soak.records import Record

SERVER_ARGS: tuple[str, ...] = (
    "--engine-beam-search",
    "--enable-chunk-cache",
    "--enable-continuation",
    "--global-cache-hit-threshold", "0",
    "--retain-kv-max-fraction", "0.2",
    "--num-gpu-blocks-override", "192",
    # Beam widths up to 16 ask for 2 x 16 log-probs (vLLM's default is 20).
    "--max-logprobs", "32",
)  # fmt: skip
"""Every feature on, a small pool: the issue's server. `Server` adds
``--enable-prompt-tokens-details`` and the test defaults."""


@dataclass(frozen=True, slots=True)
class SoakConfig:
    duration: float = 600.0
    concurrency: int = 16
    seed: int = 0
    request_timeout: float = 60.0
    sample_interval: float = 2.0
    drain_timeout: float = 30.0
    weights: dict[str, float] | None = None  # None: mix.WEIGHTS
    malformed: tuple[str, ...] | None = None  # names of MALFORMED; None: all
    topology: tuple[str, ...] = ()
    """Flags added to :data:`SERVER_ARGS`, e.g. ``--data-parallel-size 2``."""


@dataclass(slots=True)
class Drain:
    """The server after the load: how long until its pool was empty."""

    seconds: float  # waited, from the end of the load
    emptied: bool  # KV usage 0 and no request queued or running
    last: Sample | None


@dataclass(slots=True)
class SoakResult:
    config: SoakConfig
    server_args: tuple[str, ...]
    records: list[Record]
    samples: list[Sample]
    load_seconds: float
    drain: Drain
    probes: list[Record] = field(default_factory=list)
    after_probes: Drain | None = None
    alive: bool = True  # the server process was still running at the end


def start_server(
    model_dir: str,
    log_path: Path,
    topology: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Server:
    """``vllm serve`` with :data:`SERVER_ARGS` and ``topology`` on a free
    loopback port (several processes start slowly on a small machine)."""
    return Server(
        model_dir, *SERVER_ARGS, *topology, log_path=log_path, ready_timeout=900,
        env=env,
    )  # fmt: skip


async def run_soak(server: Server, config: SoakConfig) -> SoakResult:
    """Runs the load, the drain and the probes against ``server``."""
    malformed = (
        MALFORMED
        if config.malformed is None
        else {name: MALFORMED[name] for name in config.malformed}
    )
    limits = httpx.Limits(max_connections=4 * config.concurrency)
    timeout = httpx.Timeout(config.request_timeout + 5)
    async with httpx.AsyncClient(
        base_url=server.url, limits=limits, timeout=timeout
    ) as client:
        mix = Mix(
            client, Corpus.build(config.seed), timeout=config.request_timeout,
            weights=config.weights, malformed=malformed,
        )  # fmt: skip
        sampler = Sampler(
            server.url, server.process.pid, mix.t0, lambda: mix.outstanding,
            config.sample_interval,
        )  # fmt: skip
        sampling = asyncio.create_task(sampler.run())
        deadline = mix.t0 + config.duration

        def alive() -> bool:
            return server.process.poll() is None

        await asyncio.gather(
            *(
                mix.worker(random.Random(f"{config.seed}-{n}"), deadline, alive)
                for n in range(config.concurrency)
            )
        )
        load_seconds = time.monotonic() - mix.t0
        sampler.stop()
        await sampling
        async with httpx.AsyncClient(base_url=server.url) as probe_client:
            drain = await wait_until_empty(
                sampler, probe_client, MAX_TTL + config.drain_timeout
            )
            probes = await send_probes(mix, config.seed)
            after = await wait_until_empty(sampler, probe_client, 10.0)
    return SoakResult(
        config=config, server_args=SERVER_ARGS + config.topology,
        records=mix.records[:],
        samples=sampler.samples, load_seconds=load_seconds, drain=drain,
        probes=probes, after_probes=after, alive=server.process.poll() is None,
    )  # fmt: skip


def is_empty(sample: Sample) -> bool:
    return sample.kv_usage == 0 and not sample.running and not sample.waiting


async def wait_until_empty(
    sampler: Sampler, client: httpx.AsyncClient, timeout: float
) -> Drain:
    """Samples every second until the pool is empty or ``timeout`` passes."""
    start = time.monotonic()
    last: Sample | None = None
    while True:
        last = await sampler.sample(client)
        if is_empty(last):
            return Drain(time.monotonic() - start, True, last)
        if time.monotonic() - start >= timeout:
            return Drain(time.monotonic() - start, False, last)
        await asyncio.sleep(1.0)


async def send_probes(mix: Mix, seed: int) -> list[Record]:
    """A plain and a RAG request on the drained server."""
    rng = random.Random(f"{seed}-probes")
    count = len(mix.records)
    await mix.post("probe.text", "200", mix.body(rng, mix.corpus.plain_prompt(rng)))
    await mix.post("probe.rag", "200", mix.body(rng, mix.corpus.rag_prompt(rng)))
    probes = mix.records[count:]
    del mix.records[count:]
    return probes
