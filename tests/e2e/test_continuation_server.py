"""Continuation requests through `vllm serve` over HTTP, with the openai client."""

from __future__ import annotations

import itertools
import json
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import SERVED_MODEL, Server

pytestmark = pytest.mark.e2e

_fresh = itertools.count(1000)
SUFFIX = "</think>\n<|sid_begin|>"


def parent_prompt(words: int = 50) -> str:
    n = next(_fresh)
    return f"User {n} history: " + " ".join(
        f"video{(n * 17 + i) % 613}" for i in range(words)
    )


def complete(client, prompt: str | None = None, **body):
    return client.completions.create(
        model=SERVED_MODEL, prompt=prompt, max_tokens=body.pop("max_tokens", 6),
        temperature=0.0, extra_body={"cache_hit_threshold": 0, **body},
    )  # fmt: skip


def parent(client, **body):
    return complete(
        client, parent_prompt(), max_tokens=20, retain_kv=True,
        return_token_ids=True, **body,
    )  # fmt: skip


def test_child_inherits_and_equals_the_full_sequence(client, tokenizer) -> None:
    par = parent(client)
    child = complete(
        client, continuation_of=par.id, continuation_suffix=SUFFIX,
        return_token_ids=True,
    )  # fmt: skip
    suffix_ids = tokenizer.encode(SUFFIX, add_special_tokens=False)
    expected_prompt = (
        par.choices[0].prompt_token_ids + par.choices[0].token_ids + suffix_ids
    )
    assert child.choices[0].prompt_token_ids == expected_prompt
    # Only the suffix and the parent's last sampled token were computed.
    cached = child.usage.prompt_tokens_details.cached_tokens
    assert cached == len(expected_prompt) - len(suffix_ids) - 1

    reference = complete(client, expected_prompt, cache_hit_threshold=0)
    assert child.choices[0].text == reference.choices[0].text


def test_suffix_token_ids_and_chat(client) -> None:
    par = parent(client)
    by_ids = complete(
        client, continuation_of=par.id, continuation_suffix_token_ids=[5, 6]
    )
    assert by_ids.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model=SERVED_MODEL, messages=[], max_tokens=6, temperature=0.0,
        extra_body={"continuation_of": par.id, "continuation_suffix_token_ids": [5, 6]},
    )  # fmt: skip
    assert chat.choices[0].message.content == by_ids.choices[0].text


def test_chat_parent_and_child(client) -> None:
    def chat(messages, **body):
        return client.chat.completions.create(
            model=SERVED_MODEL, messages=messages, max_tokens=6, temperature=0.0,
            extra_body={"cache_hit_threshold": 0, **body},
        )  # fmt: skip

    par = chat([{"role": "user", "content": parent_prompt()}], retain_kv=True)
    child = chat([], continuation_of=par.id, continuation_suffix=SUFFIX)
    assert child.choices[0].finish_reason == "length"
    assert child.usage.prompt_tokens_details.cached_tokens > 0


def test_beam_search_continuation(client) -> None:
    par = parent(client)
    beams = complete(
        client, continuation_of=par.id, continuation_suffix=SUFFIX,
        use_beam_search=True, n=4, max_tokens=3,
    )  # fmt: skip
    assert len(beams.choices) == 4


def test_unknown_parent_is_404(client) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        complete(client, continuation_of="cmpl-does-not-exist", continuation_suffix="x")
    assert exc.value.body["param"] == "continuation_of"


def test_cache_salt_mismatch_looks_like_unknown(client) -> None:
    par = parent(client, cache_salt="tenant-a")
    with pytest.raises(openai.NotFoundError):
        complete(client, continuation_of=par.id, cache_salt="tenant-b")
    with pytest.raises(openai.NotFoundError):
        complete(client, continuation_of=par.id)
    ok = complete(client, continuation_of=par.id, cache_salt="tenant-a")
    assert ok.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "body",
    [
        {"continuation_suffix": 5},
        {"continuation_suffix": "a", "continuation_suffix_token_ids": [1]},
        {"continuation_suffix_token_ids": [-1]},
        {"continuation_choice": -1},
        {"retain_kv": "yes"},
        {"retain_kv_ttl": 0},
    ],
)
def test_malformed_fields_are_400(client, body) -> None:
    par = parent(client)
    with pytest.raises(openai.BadRequestError):
        complete(client, continuation_of=par.id, **body)


def test_prompt_with_continuation_is_400(client) -> None:
    par = parent(client)
    with pytest.raises(
        openai.BadRequestError, match="takes its prompt from the parent"
    ):
        complete(client, "not empty", continuation_of=par.id)


def test_metrics_count_continuations(client, server: Server) -> None:
    before = server.metric(
        "vllm_kvreuse:continuation_requests_total", 'outcome="resolved"'
    )
    par = parent(client)
    complete(client, continuation_of=par.id)
    after = server.metric(
        "vllm_kvreuse:continuation_requests_total", 'outcome="resolved"'
    )
    assert after == before + 1
    assert server.metric("vllm_kvreuse:continuation_cached_prompt_tokens_total") > 0


def test_expired_parent_is_404(client) -> None:
    par = parent(client, retain_kv_ttl=0.5)
    time.sleep(1.0)
    with pytest.raises(openai.NotFoundError):
        complete(client, continuation_of=par.id)


def test_disconnected_parent_retains_nothing(client, server: Server) -> None:
    """A client that goes away mid-stream aborts its request: no KV is kept
    (usage is back to 0 long before the TTL) and the id is unknown.

    The parent asks for a 300 s TTL and the check waits up to 30 s: a slow
    machine needs time to see the disconnect, and a kept parent would still
    hold its KV for minutes, so the bound separates the two without a race."""
    body = {
        "model": SERVED_MODEL, "prompt": parent_prompt(), "max_tokens": 400,
        "ignore_eos": True, "stream": True, "retain_kv": True,
        "retain_kv_ttl": 300, "cache_hit_threshold": 0,
    }  # fmt: skip
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, timeout=30
    ) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
    response_id = json.loads(first[6:])["id"]
    deadline = time.monotonic() + 30
    while server.metric("vllm:kv_cache_usage_perc") > 0:
        assert time.monotonic() < deadline, "an aborted parent kept its KV"
        time.sleep(0.1)
    with pytest.raises(openai.NotFoundError):
        complete(client, continuation_of=response_id)
