"""`vllm-router` (vllm-project/router) in front of test servers, on loopback.

The router is a separate program (the ``vllm-router`` wheel, a Rust binary
behind a Python launcher); this starts it on free loopback ports, with its
Prometheus endpoint on one of them, so a test can read which worker each
request was sent to.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from vllm_kvreuse.testing.server import free_port
from vllm_kvreuse.testing.service import Service

ROUTER = str(Path(sys.executable).parent / "vllm-router")


class Router(Service):
    """``vllm-router --policy POLICY --worker-urls URLS...``; stopped on close().

    With ``decode_urls``, P/D mode: ``worker_urls`` are the prefill servers
    (``--vllm-pd-disaggregation --prefill URL... --decode URL...``); the
    router sends each request to a prefill server with ``max_tokens=1``, then
    to a decode server. Ready once its ``/health`` answers 200, which it does
    only when every worker is healthy, so start it after the workers.
    """

    name = "vllm-router"

    def __init__(
        self,
        worker_urls: Sequence[str],
        policy: str,
        *,
        log_path: Path,
        ready_timeout: float = 60,
        decode_urls: Sequence[str] = (),
    ) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        command = [
            ROUTER, "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(self.metrics_port),
            "--policy", policy, *_workers(worker_urls, decode_urls),
        ]  # fmt: skip
        super().__init__(
            command, url=f"http://127.0.0.1:{self.port}", log_path=log_path
        )
        self.client = httpx.Client(base_url=self.url, timeout=120)
        self.wait_ready(ready_timeout, poll=0.5)

    def post(
        self, path: str, body: dict[str, Any], session: str | None = None
    ) -> tuple[int, Any]:
        """(status, parsed JSON body or, for the router's own plain-text
        errors, the text); ``session`` goes in ``X-Session-ID``."""
        headers = {"X-Session-ID": session} if session is not None else {}
        response = self.client.post(path, json=body, headers=headers)
        if response.headers.get("content-type", "").startswith("application/json"):
            return response.status_code, response.json()
        return response.status_code, response.text

    def routed(self) -> dict[str, float]:
        """Requests the router has sent to each worker URL so far.

        The policy counts a request when it picks the worker, before the
        request is forwarded, so a reply already received is counted.
        """
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics").text
        pattern = r'^vllm_router_processed_requests_total\{worker="([^"]+)"\} (\S+)$'
        return {
            m.group(1): float(m.group(2))
            for m in re.finditer(pattern, text, re.MULTILINE)
        }

    def close(self) -> None:
        self.client.close()
        super().close()


def _workers(worker_urls: Sequence[str], decode_urls: Sequence[str]) -> list[str]:
    """The router's worker arguments: plain, or P/D with ``decode_urls``."""
    if not decode_urls:
        return ["--worker-urls", *worker_urls]
    args = ["--vllm-pd-disaggregation"]
    for url in worker_urls:
        args += ["--prefill", url]
    for url in decode_urls:
        args += ["--decode", url]
    return args
