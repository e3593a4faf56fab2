"""No request body takes the server down: a table of hostile bodies against a
live `vllm serve` with every feature on and a small KV pool.

Every answer is 200 or 4xx (an OpenAI error object for 4xx), `/health` stays
200 throughout, a plain request still works at the end, and the KV pool is
back to empty (the autouse leak check in conftest).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import BLOCK_SIZE
from tests.e2e.conftest import SERVED_MODEL, Server, params_this_run
from vllm_kvreuse.testing.server_group import ServerSpec, started_together

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.v1_only(
        "a hostile body is refused by the frontend before any model runner "
        "sees it; the V2 tier adds nothing but CI time"
    ),
]

# --chunk-separator '##': the seed's text format, kept behind its flag, is
# hostile ground too (empty segments).
ALL_FEATURES = (
    "--engine-beam-search", "--enable-chunk-cache", "--chunk-separator", "##",
    "--enable-continuation",
    "--global-cache-hit-threshold", "0", "--retain-kv-ttl", "2",
    "--max-logprobs", "40", "--num-gpu-blocks-override", "96",
)  # fmt: skip
INTERNAL = ("kvreuse_beam", "kvreuse_chunks", "kvreuse_parent", "kvreuse_sealed")
HUGE = 10**18


@pytest.fixture(
    scope="module",
    params=[
        "float32",
        # vLLM's own CPU dtype: the chunk cache's bf16 layouts (docs/chunk_cache.md)
        pytest.param("bfloat16", marks=pytest.mark.v1_only("CI time; dtype is "
                     "the worker's, the frontend checks are the same")),
    ],
)  # fmt: skip
def server(by_dtype: dict[str, Server], request) -> Server:
    return by_dtype[request.param]


@pytest.fixture(scope="module")
def by_dtype(model_dir: str, tmp_path_factory, request) -> Iterator[dict[str, Server]]:
    """Every dtype's server this run uses, started together (a server start
    is CPU-bound: two at once take less than two one after the other)."""
    logs = tmp_path_factory.mktemp("hostile")
    dtypes = params_this_run(request, "server")
    specs = [  # --dtype after the settings' own: wins
        ServerSpec(d, model_dir, [*ALL_FEATURES, "--dtype", d], BLOCK_SIZE)
        for d in dtypes
    ]
    with started_together(specs, logs) as started:
        yield dict(zip(dtypes, started, strict=True))


def base(**fields: Any) -> dict[str, Any]:
    return {"model": SERVED_MODEL, "prompt": "hello", "max_tokens": 4, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {
        "model": SERVED_MODEL, "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}], **fields,
    }  # fmt: skip


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


TWO_MESSAGES = [user("a document"), user("a question")]
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0K"}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
TOOL_CALL = {"id": "call_1", "type": "function",
             "function": {"name": "f", "arguments": "{}"}}  # fmt: skip

WRONG_VALUES = ["x", -1, 0, HUGE, -HUGE, 1e308, float("nan"), [], {}, "", None, True]
PLUGIN_FIELDS = (
    "cache_hit_threshold", "retain_kv", "retain_kv_ttl", "continuation_of",
    "continuation_choice", "continuation_suffix", "continuation_suffix_token_ids",
    "chunks",
)  # fmt: skip

# Chat bodies the chunk cache refuses (chunk_messages, or the '##' separator
# in the rendered conversation): each a 4xx, never a wrong split.
CHUNKED_CHAT: list[tuple[str, str, dict[str, Any]]] = [
    *(
        (f"chat chunk_messages={value!r}", "/v1/chat/completions",
         chat(chunk_messages=value, messages=TWO_MESSAGES))
        for value in ("yes", 1, 0, [], {}, "true")
    ),
    ("chat chunk_messages: one message", "/v1/chat/completions",
     chat(chunk_messages=True)),
    ("chat chunk_messages: empty message", "/v1/chat/completions",
     chat(chunk_messages=True, messages=[user(""), user("hi")])),
    ("chat chunk_messages: null content", "/v1/chat/completions",
     chat(chunk_messages=True, messages=[user(None), user("hi")])),
    ("chat chunk_messages: empty text part", "/v1/chat/completions",
     chat(chunk_messages=True, messages=[user([{"type": "text", "text": ""}]),
                                         user("hi")])),
    ("chat chunk_messages: image part", "/v1/chat/completions",
     chat(chunk_messages=True, messages=[user([IMAGE]), user("hi")])),
    ("chat chunk_messages: image in the question", "/v1/chat/completions",
     chat(chunk_messages=True,
          messages=[user("doc"), user([{"type": "text", "text": "q"}, IMAGE])])),
    ("chat chunk_messages: tools", "/v1/chat/completions",
     chat(chunk_messages=True, messages=TWO_MESSAGES, tools=[TOOL])),
    ("chat chunk_messages: tool call", "/v1/chat/completions",
     chat(chunk_messages=True, messages=[
         user("doc"),
         {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
         {"role": "tool", "content": "42", "tool_call_id": "call_1"},
         user("q"),
     ])),
    ("chat chunk_messages: documents ignored", "/v1/chat/completions",
     chat(chunk_messages=True, messages=TWO_MESSAGES,
          documents=[{"title": "a", "text": "b"}])),
    ("chat chunk_messages: too many", "/v1/chat/completions",
     chat(chunk_messages=True, messages=[user("m")] * 300)),
    ("chat chunk_messages and a parent", "/v1/chat/completions",
     chat(chunk_messages=True, messages=[], continuation_of="nope")),
    ("chat separator: empty segment", "/v1/chat/completions",
     chat(messages=[user("a####b")])),
    # the tokenizer merges " ##": its tokens alone would not be vLLM's
    ("chat separator: merged", "/v1/chat/completions", chat(messages=[user("a ##b")])),
    ("chat separator: image", "/v1/chat/completions",
     chat(messages=[user([{"type": "text", "text": "a##b"}, IMAGE])])),
    ("chat separator: tools", "/v1/chat/completions",
     chat(messages=[user("a##b")], tools=[TOOL])),
]  # fmt: skip

BODIES: list[tuple[str, str, dict[str, Any]]] = [
    *(
        (f"{field}={value!r}", "/v1/completions", base(**{field: value}))
        for field in PLUGIN_FIELDS
        for value in WRONG_VALUES
    ),
    *(
        (f"chat {field}={value!r}", "/v1/chat/completions", chat(**{field: value}))
        for field in PLUGIN_FIELDS[:3]
        for value in ("x", -1, HUGE)
    ),
    *(
        (f"xargs {key}={value!r}", "/v1/completions", base(vllm_xargs={key: value}))
        for key in (*INTERNAL, "kvreuse_unknown")
        for value in ("x", 5, [1], {"width": 2, "max_tokens": 1, "eos_token_id": 0})
    ),
    *(
        (f"chat vllm_xargs {key}", "/v1/chat/completions", chat(vllm_xargs={key: 1}))
        for key in INTERNAL
    ),
    *(
        (f"chunks alone={value!r}", "/v1/completions", base(prompt=None, chunks=value))
        for value in WRONG_VALUES
    ),
    ("chunks: empty segment", "/v1/completions", base(prompt=None, chunks=[[1], []])),
    ("chunks: one segment", "/v1/completions", base(prompt=None, chunks=[[1, 2]])),
    ("chunks: negative id", "/v1/completions", base(prompt=None, chunks=[[-1], [2]])),
    ("chunks: huge id", "/v1/completions", base(prompt=None, chunks=[[HUGE], [2]])),
    ("chunks: floats", "/v1/completions", base(prompt=None, chunks=[[1.5], [2]])),
    ("chunks: too long", "/v1/completions",
     base(prompt=None, chunks=[[7] * 2000, [2]])),
    ("chunks and prompt", "/v1/completions", base(chunks=[[1], [2]])),
    ("chunks: empty text", "/v1/completions", base(prompt=None, chunks=["a", ""])),
    ("chunks: one text", "/v1/completions", base(prompt=None, chunks=["a"])),
    ("chunks: text and int", "/v1/completions", base(prompt=None, chunks=["a", 5])),
    ("chunks: nested text", "/v1/completions",
     base(prompt=None, chunks=[["a"], ["b"]])),
    ("chunks: text too long", "/v1/completions",
     base(prompt=None, chunks=["word " * 3000, "q"])),
    ("chunks: recompute a string", "/v1/completions",
     base(prompt=None, chunks=["a", "b"], chunk_recompute="all")),
    ("chunks: recompute a bad key", "/v1/completions",
     base(prompt=None, chunks=["a", "b"], chunk_recompute={"heads": 3})),
    ("chunks: recompute head negative", "/v1/completions",
     base(prompt=None, chunks=["a", "b"], chunk_recompute={"head": -1})),
    ("chunks: recompute select over 1", "/v1/completions",
     base(prompt=None, chunks=["a", "b"], chunk_recompute={"select": 2})),
    ("chunks: attention unknown", "/v1/completions",
     base(prompt=None, chunks=["a", "b"], chunk_attention="isolated")),
    ("separator: empty segment", "/v1/completions", base(prompt="a####b")),
    ("separator: only", "/v1/completions", base(prompt="##")),
    ("suffix ids huge", "/v1/completions",
     base(prompt=None, continuation_of="nope", continuation_suffix_token_ids=[HUGE])),
    ("beam flag a string", "/v1/completions", base(use_beam_search="yes", n=2)),
    ("chat beam flag a string", "/v1/chat/completions",
     chat(use_beam_search="yes", n=2)),
    ("beam n=0", "/v1/completions", base(use_beam_search=True, n=0)),
    ("beam n=-1", "/v1/completions", base(use_beam_search=True, n=-1)),
    ("beam n huge", "/v1/completions", base(use_beam_search=True, n=HUGE)),
    ("beam n=1000", "/v1/completions", base(use_beam_search=True, n=1000)),
    ("beam max_tokens huge", "/v1/completions",
     base(use_beam_search=True, n=2, max_tokens=HUGE)),
    ("beam stream", "/v1/completions",
     base(use_beam_search=True, n=2, stream=True)),
    ("beam on chunks", "/v1/completions",
     base(prompt=None, chunks=["a", "b", "c"], use_beam_search=True, n=2)),
    ("beam on separated prompt", "/v1/completions",
     base(prompt="a##b##c", use_beam_search=True, n=2)),
    ("beam with threshold 1", "/v1/completions",
     base(use_beam_search=True, n=2, cache_hit_threshold=1.0)),
    ("chat beam stream", "/v1/chat/completions",
     chat(use_beam_search=True, n=2, stream=True)),
    ("retain with stream", "/v1/completions",
     base(retain_kv=True, stream=True, retain_kv_ttl=0.5)),
]  # fmt: skip


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    # json.dumps turns nan into NaN, which the server may refuse as JSON: fine.
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


@pytest.mark.parametrize(("name", "path", "body"), BODIES, ids=[b[0] for b in BODIES])
def test_hostile_body_is_answered_and_the_server_serves_on(
    server: Server, name: str, path: str, body: dict[str, Any]
) -> None:
    try:
        response = post(server, path, body)
    except ValueError:  # the client refuses to encode nan: nothing was sent
        return
    assert response.status_code == 200 or 400 <= response.status_code < 500, (
        f"{name}: {response.status_code} {response.text[:300]}\n{server.log_tail()}"
    )
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["code"] == response.status_code
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


CHILD_FIELDS = {
    "continuation_choice": [-1, "a", HUGE, 1.5, None, [], 3],
    "continuation_suffix": [5, [], {}, "x" * 5000],
    "continuation_suffix_token_ids": ["x", [-1], [HUGE], [1.5], [[1]], [1] * 5000],
}


@pytest.mark.parametrize("field", list(CHILD_FIELDS))
def test_hostile_children_of_a_real_parent(server: Server, field: str) -> None:
    """Every hostile value of ``field`` on a child of a real retained parent.
    One test a field, not a value: the leak check after a test waits out the
    parents' TTL once."""
    for value in CHILD_FIELDS[field]:
        parent = post(server, "/v1/completions", base(retain_kv=True, retain_kv_ttl=1))
        assert parent.status_code == 200
        child = base(prompt=None, continuation_of=parent.json()["id"], **{field: value})
        response = post(server, "/v1/completions", child)
        assert response.status_code == 200 or 400 <= response.status_code < 500, (
            f"{field}={value!r:.40}: {response.status_code} {response.text[:300]}\n"
            f"{server.log_tail()}"
        )
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize(
    ("name", "path", "body"), CHUNKED_CHAT, ids=[b[0] for b in CHUNKED_CHAT]
)
def test_a_chat_the_chunk_cache_cannot_split_is_a_4xx(
    server: Server, name: str, path: str, body: dict[str, Any]
) -> None:
    response = post(server, path, body)
    assert 400 <= response.status_code < 500, f"{name}: {response.text[:300]}"
    error = response.json()["error"]
    assert error["message"] and error["code"] == response.status_code
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_use_beam_search_must_be_a_boolean(server: Server, path: str) -> None:
    body = (base if path == "/v1/completions" else chat)(use_beam_search="yes", n=2)
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    assert "use_beam_search must be true or false" in response.text


@pytest.mark.parametrize("key", INTERNAL)
def test_an_internal_key_is_refused_by_name(server: Server, key: str) -> None:
    response = post(server, "/v1/completions", base(vllm_xargs={key: "x"}))
    assert response.status_code == 400
    error = response.json()["error"]
    assert key in error["message"] and error["param"] == key


def test_the_server_still_serves_every_feature_afterwards(server: Server) -> None:
    plain = post(server, "/v1/completions", base())
    assert plain.status_code == 200
    chunked = post(server, "/v1/completions", base(prompt=None, chunks=["s", "q"]))
    assert chunked.status_code == 200
    separated = post(server, "/v1/completions", base(prompt="system##doc##question"))
    assert separated.status_code == 200
    by_messages = post(
        server, "/v1/chat/completions", chat(chunk_messages=True, messages=TWO_MESSAGES)
    )
    assert by_messages.status_code == 200, by_messages.text
    chat_separated = post(
        server, "/v1/chat/completions", chat(messages=[user("doc##question")])
    )
    assert chat_separated.status_code == 200, chat_separated.text
    beams = post(server, "/v1/completions", base(use_beam_search=True, n=2))
    assert beams.status_code == 200 and len(beams.json()["choices"]) == 2


def test_the_separator_flag_keeps_the_seeds_format(server: Server) -> None:
    """With --chunk-separator '##' a prompt containing it is chunked, and an
    empty segment is refused, as in the seed."""
    before = server.metric("vllm_kvreuse:chunk_cache_misses_total")
    body = base(prompt="Flag system.##Flag document.##Flag question?")
    assert post(server, "/v1/completions", body).status_code == 200
    assert server.metric("vllm_kvreuse:chunk_cache_misses_total") == before + 2
    empty = post(server, "/v1/completions", base(prompt="a####b"))
    assert empty.status_code == 400 and "empty segment" in empty.text
