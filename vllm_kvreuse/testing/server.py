"""A real `vllm serve` process on a free loopback port, for tests and benchmarks."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

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
    return env


class Server:
    """`vllm serve MODEL ARGS...` on a free loopback port; stopped on close().

    Starts with the test defaults (eager, 32-token blocks, float32); ``args``
    are appended and so override them.
    """

    def __init__(
        self,
        model_dir: str,
        *args: str,
        log_path: Path,
        block_size: int = 32,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            VLLM, "serve", model_dir, "--served-model-name", SERVED_MODEL,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--enforce-eager", "--block-size", str(block_size), "--dtype", "float32",
            "--max-model-len", "1024", "--enable-prompt-tokens-details",
            *args,
        ]  # fmt: skip
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**server_env(), **(env or {})},
        )
        self._wait_ready(timeout=300)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.close()
        raise TimeoutError(f"vllm serve not ready in {timeout}s:\n{self.log_tail()}")

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def metric(self, name: str, labels: str = "") -> float:
        """Sum of a /metrics sample's values over series matching ``labels``."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        pattern = rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$"
        total = 0.0
        for match in re.finditer(pattern, text, re.MULTILINE):
            if labels in (match.group(1) or ""):
                total += float(match.group(2))
        return total

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
