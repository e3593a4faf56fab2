"""HTTP connections pinned to one API-server process of a `vllm serve`.

With ``--api-server-count N`` every API-server process accepts on the same
listening socket, and a keep-alive connection stays with the process that
accepted it. :func:`pinned_connections` opens connections until it holds one
per process, learning which process owns each from ``/proc`` (Linux): the
server side of a TCP connection is a socket inode in ``/proc/net/tcp``, and
its owner has a file descriptor pointing at ``socket:[inode]``. Every reply
reports the process that answered it, so a test can prove a request crossed
processes.
"""

from __future__ import annotations

import http.client
import json
import os
from pathlib import Path
from typing import Any


def _server_socket_inode(server_port: int, client_port: int) -> str | None:
    """Inode of the server end of the loopback connection ``client_port``."""
    local, remote = f"0100007F:{server_port:04X}", f"0100007F:{client_port:04X}"
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == local and fields[2] == remote:
            return fields[9]
    return None


def descendants(pid: int) -> list[int]:
    """``pid``'s child processes, recursively."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "children").read_text()
        except OSError:
            continue
        for child in map(int, text.split()):
            children += [child, *descendants(child)]
    return children


def owner_of(server_pid: int, server_port: int, client_port: int) -> int | None:
    """The process of ``vllm serve`` (pid ``server_pid``) that owns the
    server end of the connection from ``client_port``."""
    inode = _server_socket_inode(server_port, client_port)
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    for pid in [server_pid, *descendants(server_pid)]:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    return pid
            except OSError:
                continue
    return None


class PinnedConnection:
    """One keep-alive HTTP connection; each reply says which process served it."""

    def __init__(self, host: str, port: int, server_pid: int) -> None:
        self.port = port
        self.server_pid = server_pid
        self.conn = http.client.HTTPConnection(host, port, timeout=300)
        self.conn.connect()
        self.pid = self._owner()

    def _owner(self) -> int | None:
        assert self.conn.sock is not None
        client_port = self.conn.sock.getsockname()[1]
        return owner_of(self.server_pid, self.port, client_port)

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any, int | None]:
        """(status, parsed body or SSE events, pid of the process that answered)."""
        self.conn.request(
            "POST", path, json.dumps(body), {"Content-Type": "application/json"}
        )
        # A closed keep-alive connection is reopened by http.client: ask again.
        pid = self._owner()
        response = self.conn.getresponse()
        raw = response.read().decode()
        if body.get("stream"):
            events = [
                json.loads(line[6:])
                for line in raw.splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
            return response.status, events, pid
        return response.status, json.loads(raw), pid

    def close(self) -> None:
        self.conn.close()


def pinned_connections(
    url: str, server_pid: int, count: int, attempts: int = 64
) -> list[PinnedConnection]:
    """``count`` connections, each to a different API-server process."""
    host, port = url.removeprefix("http://").split(":")
    held: dict[int, PinnedConnection] = {}
    spare: list[PinnedConnection] = []
    for _ in range(attempts):
        conn = PinnedConnection(host, int(port), server_pid)
        # The accepting process is known once it has served a request.
        conn.conn.request("GET", "/health")
        conn.conn.getresponse().read()
        conn.pid = conn._owner()
        if conn.pid is not None and conn.pid not in held:
            held[conn.pid] = conn
        else:
            spare.append(conn)  # kept open, so the next one goes elsewhere
        if len(held) == count:
            break
    for conn in spare:
        conn.close()
    if len(held) < count:
        raise RuntimeError(f"found {len(held)} API-server processes, not {count}")
    return list(held.values())
