"""A real `vllm serve` process with the plugin, driven over HTTP."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.conftest import BLOCK_SIZE
from vllm_kvreuse.testing.server import SERVED_MODEL, VLLM, Server, server_env

__all__ = ["SERVED_MODEL", "VLLM", "Server", "server_env"]


@pytest.fixture(scope="session")
def server(model_dir: str, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("server") / "vllm-serve.log"
    srv = Server(
        model_dir,
        "--global-cache-hit-threshold",
        "0.5",
        "--enable-continuation",
        # Retained parents expire within the leak check's wait below.
        "--retain-kv-ttl",
        "2",
        log_path=log,
        block_size=BLOCK_SIZE,
    )
    yield srv
    srv.close()


def params_this_run(request: pytest.FixtureRequest, fixture: str) -> list[str]:
    """The values of a parametrized fixture that this run's tests of the
    requesting module use (deselected and skipped ones left out), in their
    first use's order: a module fixture starts every such variant's servers
    together, none that no test runs."""
    used: dict[str, None] = {}
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if item.module is not request.module or callspec is None:
            continue
        if fixture in callspec.params and not item.get_closest_marker("skip"):
            skipif = item.get_closest_marker("skipif")
            if skipif is None or not skipif.args[0]:
                used[callspec.params[fixture]] = None
    return list(used)


@pytest.fixture(scope="session")
def tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture
def client(server: Server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(autouse=True)
def kv_pool_is_idle_after_test(request) -> Iterator[None]:
    """Nothing leaks: every server the test used is back to 0 KV usage."""
    yield
    servers: list[Server] = []
    for name in request.fixturenames:
        if name in ("server", "servers"):
            value = request.getfixturevalue(name)
            servers += list(value) if isinstance(value, tuple) else [value]
    for srv in servers:
        # A leak never frees its blocks; a slow machine frees them late: the
        # wait separates the two without racing the machine's speed.
        deadline = time.monotonic() + 60
        while (usage := srv.metric("vllm:kv_cache_usage_perc")) > 0:
            assert time.monotonic() < deadline, (
                f"KV blocks still in use on {srv.log_path.name}: {usage}\n"
                f"{srv.log_tail()}"
            )
            time.sleep(0.5)
