"""The chunk cache beside another KV connector, over HTTP.

`vllm serve --enable-chunk-cache --kv-transfer-config '{ExampleConnector}'`
runs both in vLLM's MultiConnector: the chunk cache answers for chunked
requests, vLLM's ExampleConnector (KV saved to disk) for ordinary ones, and
the cache-hit threshold counts the hits of either.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import BLOCK_SIZE
from tests.e2e.conftest import SERVED_MODEL, Server

pytestmark = pytest.mark.e2e

SYSTEM = "You answer from the documents. " * 6
DOCS = [f"Document {n}: " + f"fact {n} is about topic {n * 7}. " * 12 for n in range(2)]
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
_fresh = itertools.count()


def example_connector(storage: str, role: str = "kv_both") -> str:
    """``--kv-transfer-config`` of vLLM's ExampleConnector on ``storage``."""
    return json.dumps(
        {
            "kv_connector": "ExampleConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": storage},
        }
    )


@pytest.fixture(scope="module")
def server(model_dir: str, tmp_path_factory) -> Iterator[Server]:
    logs = tmp_path_factory.mktemp("connector")
    srv = Server(
        model_dir, "--enable-chunk-cache",
        "--kv-transfer-config", example_connector(str(logs / "kv")),
        "--global-cache-hit-threshold", "0",
        log_path=logs / "server.log", block_size=BLOCK_SIZE,
        # reset_prefix_cache is a dev-mode route.
        env={"VLLM_PLUGINS": "kvreuse", "VLLM_SERVER_DEV_MODE": "1"},
    )  # fmt: skip
    yield srv
    srv.close()


def complete(server: Server, **body) -> dict:
    body = {"model": SERVED_MODEL, "max_tokens": 4, "temperature": 0.0, **body}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def fresh_prompt() -> str:
    """About 300 tokens no other test has sent: ExampleConnector keeps all
    but the last block-aligned part, well over a 0.8 threshold."""
    n = next(_fresh)
    return f"Plain {n} " + " ".join(f"word{(n * 17 + i) % 499}" for i in range(140))


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_startup_log_names_both_connectors(server: Server) -> None:
    log = server.log_path.read_text(errors="replace")
    assert "MultiConnector" in log
    assert "ExampleConnector" in log


def test_chunked_requests_load_from_the_chunk_cache(server: Server) -> None:
    chunks = [SYSTEM, *DOCS, "Which topic?"]
    hits_before = server.metric("vllm_kvreuse:chunk_cache_hits_total")
    # No recompute: every chunk token comes from the chunk cache.
    body = {"chunks": chunks, "return_token_ids": True, "chunk_recompute": "none"}
    cold = complete(server, **body)
    warm = complete(server, **body)
    assert warm["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]
    assert cached(warm) >= warm["usage"]["prompt_tokens"] - 8  # all but the question
    # The chunk cache's /metrics still arrive through the MultiConnector.
    assert server.metric("vllm_kvreuse:chunk_cache_hits_total") >= hits_before + 3
    assert server.metric("vllm_kvreuse:chunk_cache_chunks") >= 3


def test_ordinary_requests_load_from_the_other_connector(server: Server) -> None:
    """After the local prefix cache is dropped, the KV of an ordinary prompt
    comes back from ExampleConnector's disk, and the threshold counts it."""
    prompt = fresh_prompt()
    first = complete(server, prompt=prompt)
    reset = httpx.post(f"{server.url}/reset_prefix_cache", timeout=30)
    assert reset.json() == {"success": True}
    external_before = server.metric(EXTERNAL_HITS)

    again = complete(server, prompt=prompt, cache_hit_threshold=0.8)
    choice = again["choices"][0]
    assert choice["finish_reason"] != "cache_threshold"
    assert choice["text"] == first["choices"][0]["text"]
    loaded = server.metric(EXTERNAL_HITS) - external_before
    assert loaded >= 0.8 * again["usage"]["prompt_tokens"]
    assert cached(again) >= loaded


def test_threshold_refuses_a_prompt_no_connector_has(server: Server) -> None:
    """The control: the same threshold on a prompt nobody stored."""
    answer = complete(server, prompt=fresh_prompt(), cache_hit_threshold=0.8)
    assert answer["choices"][0]["finish_reason"] == "cache_threshold"
    assert answer["usage"]["completion_tokens"] == 0
