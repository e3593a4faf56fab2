"""A real `vllm serve` process on a free loopback port, for tests and benchmarks."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from vllm_kvreuse.testing.service import Service

VLLM = str(Path(sys.executable).parent / "vllm")
SERVED_MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    # The server runs vLLM's normal layout: engine core in its own process.
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # FlashInfer is optional on CUDA; its sampler must be off without it.
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return env


def on_gpu() -> bool:
    """Whether servers started here run on a CUDA device."""
    import torch

    return torch.cuda.is_available()


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """How a test or benchmark server runs the model.

    The defaults fit the device: on CPU float32 and eager (vllm-cpu needs
    both here, and float32 keeps greedy outputs exact); on a GPU what users
    run (the model's dtype, CUDA graphs) with a fixed KV cache size.

    Why a fixed size on a GPU (``--kv-cache-memory-bytes``): vLLM sizes its
    KV cache by profiling the memory the device has left, which assumes no
    neighbour allocates meanwhile; servers started together would each see
    the others' allocations as their own and fail or shrink. A fixed size
    skips that profiling, so servers start together and get what they were
    given. ``gpu_memory_utilization`` then only sets the free memory vLLM
    insists on at start, so it is kept small.
    """

    dtype: str = "float32"
    enforce_eager: bool = True
    gpu_memory_utilization: float | None = None
    kv_cache_bytes: int | None = None

    @classmethod
    def for_device(cls) -> ServerSettings:
        """As users run vLLM on this device (benchmarks)."""
        if on_gpu():
            return cls(dtype="auto", enforce_eager=False, kv_cache_bytes=4 * 2**30)
        return cls()

    @classmethod
    def for_tests(cls) -> ServerSettings:
        """float32 and eager everywhere, so outputs compare exactly; a small
        fixed KV cache on a GPU, so several servers fit one card."""
        return cls(kv_cache_bytes=2**30 if on_gpu() else None)

    def args(self) -> list[str]:
        args = ["--dtype", self.dtype]
        if self.enforce_eager:
            args.append("--enforce-eager")
        utilization = self.gpu_memory_utilization
        if self.kv_cache_bytes is not None:
            args += ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
            utilization = utilization or 0.02
        if utilization is not None:
            args += ["--gpu-memory-utilization", str(utilization)]
        return args

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """``--dtype``, ``--enforce-eager``, ``--gpu-memory-utilization``,
        ``--kv-cache-gib`` and ``--ready-timeout`` for a benchmark's servers
        (defaults: :meth:`for_device`)."""
        group = parser.add_argument_group("servers")
        group.add_argument("--dtype", default=None, help="default: per device")
        group.add_argument(
            "--enforce-eager", action=argparse.BooleanOptionalAction, default=None
        )
        group.add_argument("--gpu-memory-utilization", type=float, default=None)
        group.add_argument(
            "--kv-cache-gib", type=float, default=None,
            help="each server's KV cache (GPU default: 4 GiB, a fixed size so "
            "that servers start together; CPU: VLLM_CPU_KVCACHE_SPACE)",
        )  # fmt: skip
        group.add_argument(
            "--ready-timeout", type=float, default=600,
            help="seconds the servers, started together, have to be ready",
        )  # fmt: skip

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerSettings:
        base = cls.for_device()
        kv_bytes = base.kv_cache_bytes
        if args.kv_cache_gib is not None:
            kv_bytes = int(args.kv_cache_gib * 2**30)
        return cls(
            dtype=args.dtype or base.dtype,
            enforce_eager=base.enforce_eager
            if args.enforce_eager is None
            else args.enforce_eager,
            gpu_memory_utilization=args.gpu_memory_utilization
            or base.gpu_memory_utilization,
            kv_cache_bytes=kv_bytes if on_gpu() else None,
        )


def metric(url: str, name: str, labels: str = "") -> float:
    """Sum of the values of ``url``'s /metrics sample ``name`` over the
    series whose labels contain ``labels``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pattern = rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$"
    total = 0.0
    for match in re.finditer(pattern, text, re.MULTILINE):
        if labels in (match.group(1) or ""):
            total += float(match.group(2))
    return total


OWN_PROCESS_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
)
"""``Popen`` arguments that start a child in a process group of its own
(``process_group`` is new in Python 3.11)."""


class Server(Service):
    """`vllm serve MODEL ARGS...` on a free loopback port; stopped on close().

    Starts with 32-token blocks and ``settings`` (default: the tests', see
    :class:`ServerSettings`); ``args`` are appended and so override them.
    Returns once it is ready, or at once with ``ready_timeout=None`` (then
    :meth:`wait_ready`, or :func:`~vllm_kvreuse.testing.server_group.start_servers`
    for several at once).
    """

    name = "vllm serve"
    stop_timeout = 30

    def __init__(
        self,
        model_dir: str,
        *args: str,
        log_path: Path,
        block_size: int = 32,
        env: dict[str, str] | None = None,
        settings: ServerSettings | None = None,
        ready_timeout: float | None = 300,
    ) -> None:
        self.port = free_port()
        settings = settings or ServerSettings.for_tests()
        cmd = [
            VLLM, "serve", model_dir, "--served-model-name", SERVED_MODEL,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--block-size", str(block_size), *settings.args(),
            "--max-model-len", "1024", "--enable-prompt-tokens-details",
            *args,
        ]  # fmt: skip
        super().__init__(
            cmd,
            url=f"http://127.0.0.1:{self.port}",
            log_path=log_path,
            env={**server_env(), **(env or {})},
            # Its own process group: close() ends the engine core and workers
            # too, also when the server is stopped before it is ready (the
            # API server alone left its engine core running then). Not its
            # own session: with the kernel's autogroup scheduling a session
            # is a CPU share of its own, which held the server to about half
            # the machine against its client (the soak served 30% fewer
            # requests).
            **OWN_PROCESS_GROUP,
        )
        self.started = time.monotonic()
        if ready_timeout is not None:
            self.wait_ready(ready_timeout, poll=1)

    def metric(self, name: str, labels: str = "") -> float:
        """Sum of a /metrics sample's values over series matching ``labels``."""
        return metric(self.url, name, labels)

    def close(self) -> None:
        super().close()
        with contextlib.suppress(ProcessLookupError):  # stragglers of the group
            os.killpg(self.process.pid, signal.SIGKILL)
