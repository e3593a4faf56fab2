"""Stored chunks copied to host memory off the step's path.

A chunk the store moves from its device tier to its CPU tier needs host
memory (pinned, so the device can copy from it again) and a device-to-host
copy. Done on the worker's thread, both stall the step that asked: on an
H200 the GPU report's first sight at 32K tokens took 1.90x plain vLLM while
57 chunks (3.8 GB) moved down inside its steps (``docs/results/
gpu_report.md``). :class:`HostCopies` does them on a thread and a stream of
their own, after the work that wrote the chunk (an event recorded on the
step's stream when the copy is asked for).

Invariants:

- a copy reads the chunk only after everything queued before it on the
  step's stream (its save): the event;
- the caller gets the host tensor (``done``) only once the copy is
  complete: the side stream is synchronized first;
- at most ``budget`` bytes are in flight (device memory the store's
  accounting has already given back); past it, and where the device has no
  stream API this module uses (only CUDA does), :meth:`HostCopies.start`
  returns False and the caller copies in the step, as before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from vllm.logger import init_logger

logger = init_logger(__name__)

IN_FLIGHT_BYTES = 1 << 30
"""Device memory the copies in flight may hold past the store's accounting."""

Copy = Callable[[torch.Tensor], Callable[[], torch.Tensor]]
"""Starts a copy on the caller's thread (records what it must wait for);
the returned call finishes it on the copy thread and returns the host
tensor."""


def host_like(tensor: torch.Tensor) -> torch.Tensor:
    """An empty host tensor for ``tensor``, pinned where the device copies
    from it (a pageable copy is staged by the driver: slower, not async)."""
    from vllm.utils.platform_utils import is_pin_memory_available

    return torch.empty_like(tensor, device="cpu", pin_memory=is_pin_memory_available())


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in host memory, copied now (on the caller's stream)."""
    if tensor.device.type == "cpu":
        return tensor
    host = host_like(tensor)
    host.copy_(tensor)
    return host


def cuda_copy(device: torch.device) -> Copy:
    """Copies on a stream of their own, each after the work queued on the
    step's stream when it was started."""
    stream = torch.cuda.Stream(device)

    def start(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))

        def finish() -> torch.Tensor:
            # This thread's current device is the default one: name it.
            with torch.cuda.device(device):
                host = host_like(tensor)
                with torch.cuda.stream(stream):
                    stream.wait_event(ready)
                    host.copy_(tensor, non_blocking=True)
                stream.synchronize()
            return host

        return finish

    return start


class HostCopies:
    """Device-to-host copies of stored chunks on one background thread."""

    def __init__(self, copy: Copy, budget: int) -> None:
        self.copy, self.budget = copy, budget
        self._in_flight = 0  # bytes
        self._lock = threading.Lock()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvreuse-host-copy")

    @classmethod
    def for_device(
        cls, device: torch.device, budget: int = IN_FLIGHT_BYTES
    ) -> HostCopies | None:
        """Background copies where the device has a stream API this module
        uses (CUDA); None elsewhere (the caller copies in the step)."""
        if device.type != "cuda":
            return None
        return cls(cuda_copy(device), budget)

    def start(self, tensor: torch.Tensor, done: Callable[[torch.Tensor], None]) -> bool:
        """Starts copying ``tensor`` to the host; ``done(host)`` runs on the
        copy thread once the copy is complete. False, starting nothing,
        when ``budget`` bytes are in flight already or the copy cannot
        start."""
        size = tensor.numel() * tensor.element_size()
        with self._lock:
            if self._in_flight + size > self.budget:
                return False
            self._in_flight += size
        try:
            finish = self.copy(tensor)
        except Exception as error:  # the caller copies in the step
            logger.warning("chunk cache: cannot start a copy to host: %s", error)
            with self._lock:
                self._in_flight -= size
            return False

        def run() -> None:
            try:
                done(finish())
            except Exception as error:  # the chunk stays where it was
                logger.warning("chunk cache: a copy to host memory failed: %s", error)
            finally:
                with self._lock:
                    self._in_flight -= size

        self._thread.submit(run)
        return True

    def close(self) -> None:
        """Waits for the copies in flight."""
        self._thread.shutdown(wait=True)
