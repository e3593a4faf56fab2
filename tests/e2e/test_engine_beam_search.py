"""Engine-side beam search (--engine-beam-search) against vLLM's own front-end
beam search, over HTTP, on two real servers with the same model."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import SERVED_MODEL, Server
from vllm_kvreuse.testing.server_group import ServerSpec, started_together

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.v1_only(
        "CI time: two servers; the V2 tier runs engine beams against vLLM's loop "
        "and an aborted search in tests/integration/test_beam_search_engine.py, "
        "and behind vllm serve in test_catalog_server.py"
    ),
]


@pytest.fixture(scope="module")
def servers(model_dir: str, tmp_path_factory) -> Iterator[tuple[Server, Server]]:
    logs = tmp_path_factory.mktemp("beam")
    common = ["--max-logprobs", "32"]
    engine_flags = ["--engine-beam-search", "--enable-continuation",
                    "--retain-kv-ttl", "2", "--max-num-seqs", "16"]  # fmt: skip
    specs = [
        ServerSpec("frontend", model_dir, common),
        ServerSpec("engine", model_dir, [*common, *engine_flags]),
    ]
    with started_together(specs, logs) as (frontend, engine):
        yield frontend, engine


def beams(server: Server, prompt: list[int], width: int, max_tokens: int = 3) -> dict:
    body = {
        "model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens,
        "use_beam_search": True, "n": width, "return_token_ids": True,
    }  # fmt: skip
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 131 + i * 17) % 3500 + 50 for i in range(length)]


@pytest.mark.parametrize("width", [4, 8])
def test_same_beams_as_front_end_beam_search(servers, width: int) -> None:
    reference, engine = servers
    for seed in range(8):
        p = prompt(seed, 40 + 7 * seed)  # partial last blocks of many sizes
        expected = beams(reference, p, width)
        got = beams(engine, p, width)
        want = [(c["token_ids"], c["finish_reason"]) for c in expected["choices"]]
        have = [(c["token_ids"], c["finish_reason"]) for c in got["choices"]]
        assert have == want, f"prompt {seed}: beams differ"


def test_forks_and_usage_are_reported(servers) -> None:
    _, engine = servers
    before = engine.metric("vllm_kvreuse:beam_forks_total")
    groups = engine.metric("vllm_kvreuse:beam_groups_total")
    computed = engine.metric("vllm_kvreuse:beam_computed_prompt_tokens_total")
    as_one = engine.metric("vllm_kvreuse:beam_steps_as_one_total")
    result = beams(engine, prompt(99, 70), width=4, max_tokens=3)
    assert result["usage"]["prompt_tokens_details"] is not None
    assert engine.metric("vllm_kvreuse:beam_groups_total") == groups + 1
    # The root's step forks 4 beams (new members); the members' first step
    # moves those whose beam died onto another parent; the last puts no
    # beam on another's KV (its beams are final). Each beam computes one token.
    assert before + 4 <= engine.metric("vllm_kvreuse:beam_forks_total") <= before + 8
    assert (
        engine.metric("vllm_kvreuse:beam_computed_prompt_tokens_total") == computed + 8
    )
    # Steps 2 and 3 ran as one request, the members' first included (the
    # group admitted them whole).
    assert engine.metric("vllm_kvreuse:beam_steps_as_one_total") == as_one + 2


def test_width_over_the_running_seats_is_400(servers) -> None:
    """A step runs every beam at once: 20 beams on 16 seats is refused, with
    the flag that would change it. (No log-prob rows come back, so
    --max-logprobs does not bound the width: 20 > 32 / 2 is no longer it.)"""
    _, engine = servers
    body = {
        "model": SERVED_MODEL, "prompt": prompt(5, 40), "max_tokens": 2,
        "use_beam_search": True, "n": 20,
    }  # fmt: skip
    response = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert "--max-num-seqs" in response.json()["error"]["message"]
    body["n"] = 16
    response = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 16


def test_streaming_beam_search_is_400(servers) -> None:
    _, engine = servers
    body = {
        "model": SERVED_MODEL, "prompt": prompt(6, 40), "max_tokens": 2,
        "use_beam_search": True, "n": 2, "stream": True,
    }  # fmt: skip
    response = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400


def test_continuation_then_engine_beam_search(servers) -> None:
    """OpenOneRec stage 2: beams start from a retained stage-1 parent."""
    reference, engine = servers
    stage1 = httpx.post(
        f"{engine.url}/v1/completions",
        json={
            "model": SERVED_MODEL, "prompt": prompt(7, 90), "max_tokens": 20,
            "temperature": 0.0, "retain_kv": True, "return_token_ids": True,
        },
        timeout=60,
    ).json()  # fmt: skip
    choice = stage1["choices"][0]
    suffix = [3, 4, 5]
    child = httpx.post(
        f"{engine.url}/v1/completions",
        json={
            "model": SERVED_MODEL, "continuation_of": stage1["id"],
            "continuation_suffix_token_ids": suffix, "use_beam_search": True,
            "n": 4, "max_tokens": 3, "return_token_ids": True,
        },
        timeout=60,
    ).json()  # fmt: skip
    full = choice["prompt_token_ids"] + choice["token_ids"] + suffix
    expected = beams(reference, full, 4)
    assert [c["token_ids"] for c in child["choices"]] == [
        c["token_ids"] for c in expected["choices"]
    ]
    # The root inherited stage 1's KV: only the suffix and one token computed.
    cached = child["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == len(full) - len(suffix) - 1


def test_client_disconnect_frees_the_whole_group(servers) -> None:
    """The leak check after this test asserts every beam's blocks came back."""
    _, engine = servers
    body = {
        "model": SERVED_MODEL, "prompt": prompt(8, 300), "max_tokens": 700,
        "use_beam_search": True, "n": 8, "ignore_eos": True,
    }  # fmt: skip
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{engine.url}/v1/completions", json=body, timeout=0.5)
    # The server is still serving.
    assert beams(engine, prompt(9, 40), width=2)["choices"]


def test_chat_beam_search_matches_front_end(servers) -> None:
    reference, engine = servers
    messages = [{"role": "user", "content": "item42 " * 30}]
    body = {
        "model": SERVED_MODEL, "messages": messages,
        "max_tokens": 3, "use_beam_search": True, "n": 4,
    }  # fmt: skip

    def contents(server: Server) -> list[str]:
        response = httpx.post(
            f"{server.url}/v1/chat/completions", json=body, timeout=120
        )
        assert response.status_code == 200, response.text
        return [c["message"]["content"] for c in response.json()["choices"]]

    assert contents(engine) == contents(reference)
