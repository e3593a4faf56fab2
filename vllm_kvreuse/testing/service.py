"""A program serving HTTP on loopback for a test: its output in a log file,
ready once ``/health`` answers 200, stopped on :meth:`Service.close`.

:class:`~vllm_kvreuse.testing.server.Server` (``vllm serve``) and
:class:`~vllm_kvreuse.testing.router.Router` (``vllm-router``) are two.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import httpx

_S = TypeVar("_S", bound="Service")


class Service:
    """``command`` started with its output in ``log_path``, serving ``url``.

    The process and the log file are this object's: :meth:`close` (or the
    end of a ``with`` block) stops the one and closes the other.
    """

    name: ClassVar[str] = "service"
    """The program, as errors name it."""
    stop_timeout: ClassVar[float] = 10
    """Seconds :meth:`close` waits after SIGTERM before SIGKILL."""

    def __init__(
        self, command: Sequence[str], *, url: str, log_path: Path, **popen: Any
    ) -> None:
        self.command = list(command)
        self.url = url
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen(
            self.command, stdout=self._log, stderr=subprocess.STDOUT, **popen
        )

    def is_ready(self) -> bool:
        """Whether ``/health`` answers 200 now; raises if the program exited."""
        if self.process.poll() is not None:
            raise RuntimeError(f"{self.name} exited:\n{self.log_tail()}")
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float, poll: float) -> None:
        """Returns once ``/health`` answers 200; raises (and closes) if the
        program exits first or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.is_ready():
                return
            time.sleep(poll)
        self.close()
        raise TimeoutError(f"{self.name} not ready in {timeout}s:\n{self.log_tail()}")

    def log_tail(self, num_chars: int = 4000) -> str:
        """The last ``num_chars`` bytes of the log, decoded."""
        with open(self.log_path, "rb") as log:
            log.seek(0, 2)
            log.seek(max(0, log.tell() - num_chars))
            return log.read().decode(errors="replace")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
