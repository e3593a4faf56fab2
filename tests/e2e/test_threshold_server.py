"""The cache-hit threshold through `vllm serve` over HTTP, with the openai client."""

from __future__ import annotations

import itertools
import json
import subprocess

import httpx
import openai
import pytest

from tests.e2e.conftest import SERVED_MODEL, VLLM, Server, server_env

pytestmark = pytest.mark.e2e

REJECTIONS = "vllm_kvreuse:cache_threshold_rejections_total"
_fresh = itertools.count()


def fresh_prompt(words: int = 60) -> str:
    """A prompt no other test has sent, long enough to fill a few blocks."""
    n = next(_fresh)
    return f"Request {n} " + " ".join(f"item{(n * 31 + i) % 997}" for i in range(words))


def complete(client, prompt: str, **body):
    return client.completions.create(
        model=SERVED_MODEL, prompt=prompt, max_tokens=4, temperature=0.0,
        extra_body=body or None,
    )  # fmt: skip


@pytest.mark.v1_only("command-line parsing: no engine runs")
def test_help_lists_the_flag() -> None:
    out = subprocess.run(
        [VLLM, "serve", "--help=vllm-kvreuse"],
        capture_output=True, text=True, env=server_env(), timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--global-cache-hit-threshold" in out.stdout


@pytest.mark.v1_only("command-line parsing: no engine runs")
def test_bad_flag_value_stops_startup(model_dir: str) -> None:
    out = subprocess.run(
        [VLLM, "serve", model_dir, "--global-cache-hit-threshold", "1.5"],
        capture_output=True, text=True, env=server_env(), timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert "--global-cache-hit-threshold must be a number in [0, 1]" in out.stderr


def test_cold_rejected_warm_accepted_override_wins(client, server: Server) -> None:
    prompt = fresh_prompt()
    rejected_before = server.metric(REJECTIONS, 'stage="admission"')

    cold = complete(client, prompt)
    assert cold.choices[0].finish_reason == "cache_threshold"
    assert cold.choices[0].text == ""
    assert cold.usage.completion_tokens == 0

    seeded = complete(client, prompt, cache_hit_threshold=0.0)  # request beats flag
    assert seeded.choices[0].finish_reason == "length"

    warm = complete(client, prompt)
    assert warm.choices[0].finish_reason == "length"
    assert warm.choices[0].text == seeded.choices[0].text
    assert warm.usage.prompt_tokens_details.cached_tokens >= 32

    strict = complete(client, prompt, cache_hit_threshold=0.999)
    assert strict.choices[0].finish_reason == "cache_threshold"

    assert server.metric(REJECTIONS, 'stage="admission"') == rejected_before + 2


def test_streaming_completion_rejection(client) -> None:
    stream = client.completions.create(
        model=SERVED_MODEL, prompt=fresh_prompt(), max_tokens=4, stream=True
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "cache_threshold"
    assert "".join(c.choices[0].text for c in chunks) == ""


def chat(client, content: str, stream: bool = False, **body):
    return client.chat.completions.create(
        model=SERVED_MODEL, messages=[{"role": "user", "content": content}],
        max_tokens=4, temperature=0.0, stream=stream, extra_body=body or None,
    )  # fmt: skip


def test_chat_rejection_and_acceptance(client) -> None:
    content = fresh_prompt()
    cold = chat(client, content)
    assert cold.choices[0].finish_reason == "cache_threshold"
    assert (
        chat(client, content, cache_hit_threshold=0).choices[0].finish_reason
        == "length"
    )
    assert chat(client, content).choices[0].finish_reason == "length"


def test_streaming_chat_rejection(client) -> None:
    chunks = list(chat(client, fresh_prompt(), stream=True))
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "cache_threshold"


@pytest.mark.parametrize("bad", [1.5, -1, "abc", [0.5], True])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bad_request_value_is_400_and_server_keeps_serving(
    client, endpoint: str, bad
) -> None:
    call = complete if endpoint == "completions" else chat
    with pytest.raises(openai.BadRequestError) as exc:
        call(client, fresh_prompt(), cache_hit_threshold=bad)
    assert exc.value.status_code == 400
    error = exc.value.body
    assert "cache_hit_threshold must be a number in [0, 1]" in error["message"]
    assert (
        call(client, fresh_prompt(), cache_hit_threshold=0).choices[0].finish_reason
        == "length"
    )


def test_nan_is_400(server: Server) -> None:
    """JSON allows NaN only as a non-standard literal; send it raw."""
    body = (
        '{"model": "%s", "prompt": "hi", "max_tokens": 2, "cache_hit_threshold": NaN}'
    )
    response = httpx.post(
        f"{server.url}/v1/completions",
        content=body % SERVED_MODEL,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 400
    assert "cache_hit_threshold" in json.dumps(response.json())
