"""A P/D pair on one machine, with the cache-hit threshold on the decoder.

A prefill and a decode `vllm serve` share KV through vLLM's ExampleConnector
(safetensors files under one storage path: a real KV-transfer connector that
runs on CPU, standing in for NIXL or Mooncake). The decoder runs
``--global-cache-hit-threshold 0.9``: a request whose KV the connector
supplies is decoded; one whose KV is missing comes back as
``finish_reason: "cache_threshold"`` without being computed there, and the
proxy in front prefills it and sends it again.
"""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import SERVED_MODEL, Server
from tests.e2e.test_connector_server import example_connector
from vllm_kvreuse.testing.router import ROUTER, Router
from vllm_kvreuse.testing.server_group import ServerSpec, started_together

pytestmark = [
    pytest.mark.e2e,
    # Two engines through the interpreted V2 runner would take most of CI's
    # V2 budget; the transfer is the connector's and the threshold the
    # scheduler's, the same under both runners.
    pytest.mark.v1_only(
        "CI time: two servers; connector and threshold are runner-independent"
    ),
]

REJECTIONS = "vllm_kvreuse:cache_threshold_rejections_total"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
_fresh = itertools.count()


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pd") / "kv"


@pytest.fixture(scope="module")
def servers(model_dir: str, storage: Path, tmp_path_factory) -> Iterator[tuple]:
    """(prefill, decode)."""
    logs = tmp_path_factory.mktemp("pd-logs")
    producer = ["--kv-transfer-config", example_connector(str(storage), "kv_producer")]
    consumer = ["--kv-transfer-config", example_connector(str(storage), "kv_consumer"),
                "--global-cache-hit-threshold", "0.9"]  # fmt: skip
    specs = [
        ServerSpec("prefill", model_dir, producer),
        ServerSpec("decode", model_dir, consumer),
    ]
    with started_together(specs, logs) as (prefill, decode):
        yield prefill, decode


def fresh_prompt() -> str:
    """About 500 tokens no other test has sent. ExampleConnector stores all
    but the last partial block (under 33 tokens): over 0.9 of the prompt."""
    n = next(_fresh)
    return f"Passage {n} " + " ".join(f"term{(n * 13 + i) % 389}" for i in range(95))


def complete(server: Server, prompt: str, max_tokens: int = 4) -> dict:
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0}  # fmt: skip
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def decode_first(servers: tuple[Server, Server], prompt: str) -> tuple[dict, list[str]]:
    """A proxy that tries the decoder first (it may hold the KV already) and
    acts on its refusal: prefill (``max_tokens=1``, as vLLM's
    disaggregated-serving proxy does), then decode again. Returns the answer
    and the servers it went to."""
    prefill, decode = servers
    answer, path = complete(decode, prompt), ["decode"]
    if answer["choices"][0]["finish_reason"] == "cache_threshold":
        complete(prefill, prompt, max_tokens=1)
        answer, path = complete(decode, prompt), [*path, "prefill", "decode"]
    return answer, path


def test_missing_kv_is_refused_not_computed_on_the_decoder(servers, storage) -> None:
    _, decode = servers
    stored_before = set(storage.glob("*"))
    rejected_before = decode.metric(REJECTIONS)

    answer = complete(decode, fresh_prompt())
    assert answer["choices"][0]["finish_reason"] == "cache_threshold"
    assert answer["usage"]["completion_tokens"] == 0
    assert decode.metric(REJECTIONS) == rejected_before + 1
    # The decoder's connector saves whatever it computes: nothing was.
    assert set(storage.glob("*")) == stored_before


def test_purged_kv_is_refused_then_the_proxy_prefills(servers, storage) -> None:
    prefill, _ = servers
    prompt = fresh_prompt()
    stored_before = set(storage.glob("*"))
    complete(prefill, prompt, max_tokens=1)
    written = set(storage.glob("*")) - stored_before
    assert len(written) == 1, "the prefill server saved one prompt's KV"
    shutil.rmtree(written.pop())  # purged before the decoder reads it

    answer, path = decode_first(servers, prompt)
    assert path == ["decode", "prefill", "decode"]
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= (
        0.9 * answer["usage"]["prompt_tokens"]
    )
    assert (
        answer["choices"][0]["text"] == complete(prefill, prompt)["choices"][0]["text"]
    )


def test_prefilled_kv_is_decoded_without_a_second_prefill(servers) -> None:
    prefill, _ = servers
    prompt = fresh_prompt()
    complete(prefill, prompt, max_tokens=1)
    answer, path = decode_first(servers, prompt)
    assert path == ["decode"]
    assert answer["choices"][0]["finish_reason"] == "length"


@pytest.mark.skipif(not Path(ROUTER).exists(), reason=f"no vllm-router at {ROUTER}")
def test_vllm_router_in_pd_mode_drives_the_pair(servers, tmp_path) -> None:
    """vllm-router --vllm-pd-disaggregation: prefill (max_tokens=1), then
    decode; the decoder loads the prompt's KV from the connector."""
    prefill, decode = servers
    prompt = fresh_prompt()
    loaded_before = decode.metric(EXTERNAL_HITS)
    with Router(
        [prefill.url], "round_robin", log_path=tmp_path / "router.log",
        decode_urls=[decode.url],
    ) as router:  # fmt: skip
        body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 4,
                "temperature": 0.0}  # fmt: skip
        status, answer = router.post("/v1/completions", body)
    assert status == 200, answer
    assert answer["choices"][0]["finish_reason"] == "length"
    loaded = decode.metric(EXTERNAL_HITS) - loaded_before
    assert loaded >= 0.9 * answer["usage"]["prompt_tokens"]
    assert (
        answer["choices"][0]["text"] == complete(prefill, prompt)["choices"][0]["text"]
    )
