"""The chunk cache over HTTP: `vllm serve --enable-chunk-cache` and the openai
client, against a plain server of the same model."""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import pytest
import torch
from vllm.platforms import current_platform

from tests.conftest import BLOCK_SIZE
from tests.e2e.conftest import SERVED_MODEL, Server, params_this_run
from vllm_kvreuse.testing.server_group import ServerSpec, started_together

pytestmark = pytest.mark.e2e

BF16_RUNS = not current_platform.is_cpu() or (
    torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
)
"""vLLM's CPU kernels run bfloat16 with AVX512-BF16 or AMX (then its default)."""

SYSTEM = "You answer from the documents. " * 6
DOCS = [f"Document {n}: " + f"fact {n} is about topic {n * 7}. " * 12 for n in range(3)]


@pytest.fixture(
    scope="module",
    params=[
        "float32",
        # vLLM's own CPU dtype where the CPU has bfloat16 instructions: the
        # chunk cache's bfloat16 KV layouts (docs/chunk_cache.md, "Numerics").
        pytest.param("bfloat16", marks=[
            pytest.mark.v1_only("CI time: the worker's dtype, not the runner's"),
            pytest.mark.skipif(not BF16_RUNS, reason="no AVX512-BF16 or AMX"),
        ]),
    ],
)  # fmt: skip
def servers(pairs: dict[str, tuple[Server, Server]], request) -> tuple[Server, Server]:
    """A plain server and a chunk-cache server of the same model and dtype."""
    return pairs[request.param]


@pytest.fixture(scope="module")
def pairs(
    model_dir: str, tmp_path_factory, request
) -> Iterator[dict[str, tuple[Server, Server]]]:
    """Every dtype's pair this run uses, all started together (a server
    start is CPU-bound: together they take less than one after another)."""
    logs = tmp_path_factory.mktemp("chunks")
    dtypes = params_this_run(request, "servers")
    specs = []
    for d in dtypes:
        dtype = ("--dtype", d)  # after the settings' own --dtype: wins
        specs += [
            ServerSpec(f"plain-{d}", model_dir, dtype),
            ServerSpec(
                f"chunked-{d}", model_dir, ["--enable-chunk-cache", *dtype],
                env={"VLLM_PLUGINS": "kvreuse"},
            ),
        ]  # fmt: skip
    with started_together(specs, logs) as started:
        yield {d: (started[2 * i], started[2 * i + 1]) for i, d in enumerate(dtypes)}


def complete(server: Server, **body) -> httpx.Response:
    body = {"model": SERVED_MODEL, "max_tokens": 6, "temperature": 0.0, **body}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)


def rag_chunks(order: list[int], question: str = "Which topic?") -> list[str]:
    return [SYSTEM, *(DOCS[n] for n in order), question]


def test_new_documents_are_answered_as_plain_vllm_answers_them(servers) -> None:
    """First sight: documents neither server has seen are computed in place,
    so the chunked request gets plain vLLM's tokens and log-probs for the
    same token ids, with nothing cached."""
    plain, chunked = servers
    chunks = [SYSTEM + " New. ", "Fresh document: " + DOCS[0], "First sight?"]
    body = {"return_token_ids": True, "logprobs": 3}
    got = complete(chunked, chunks=chunks, **body).json()
    token_ids = got["choices"][0]["prompt_token_ids"]
    want = complete(plain, prompt=token_ids, **body).json()
    assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    for ours, theirs in zip(
        got["choices"][0]["logprobs"]["top_logprobs"],
        want["choices"][0]["logprobs"]["top_logprobs"],
        strict=True,
    ):
        assert ours.keys() == theirs.keys()
        assert all(abs(ours[t] - theirs[t]) < 1e-4 for t in ours)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_cold_and_warm_give_the_same_answer_and_warm_is_cached(servers) -> None:
    """With no recompute (``chunk_recompute: "none"``) everything but the
    question is cached."""
    _, chunked = servers
    body = {"chunks": rag_chunks([0, 1]), "return_token_ids": True}
    cold = complete(chunked, **body, chunk_recompute="none").json()
    warm = complete(chunked, **body, chunk_recompute="none").json()
    assert warm["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= warm["usage"]["prompt_tokens"] - 8  # all but the question
    # return_token_ids: the concatenated segments, each tokenised alone.
    text = chunked_text(chunked, warm["choices"][0]["prompt_token_ids"])
    assert text == "".join(rag_chunks([0, 1]))


def chunked_text(server: Server, token_ids: list[int]) -> str:
    response = httpx.post(
        f"{server.url}/detokenize",
        json={"model": SERVED_MODEL, "tokens": token_ids},
        timeout=30,
    )
    return response.json()["prompt"]


def test_reordered_documents_reuse_their_chunks(servers) -> None:
    _, chunked = servers
    complete(chunked, chunks=rag_chunks([1, 2]))
    chunks = rag_chunks([2, 1], "Another question?")
    swapped = complete(chunked, chunks=chunks, chunk_recompute="none")
    assert swapped.status_code == 200
    usage = swapped.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 8


def test_the_default_recomputes_spans_and_cold_equals_warm(servers) -> None:
    """The server's default settings recompute chunk heads and a tail: the
    rest comes from the store; the same request sent again answers the same."""
    _, chunked = servers
    chunks = rag_chunks([2, 0], "Which document?")
    cold = complete(chunked, chunks=chunks, return_token_ids=True).json()
    reordered = complete(chunked, chunks=rag_chunks([0, 2], "Which document?"))
    usage = reordered.json()["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < usage["prompt_tokens"] - 8  # loaded, less what is recomputed
    warm = complete(chunked, chunks=chunks, return_token_ids=True).json()
    assert warm["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]


def test_token_id_segments(servers, tokenizer) -> None:
    _, chunked = servers
    segments = [tokenizer.encode(s) for s in (SYSTEM, DOCS[0], "Why?")]
    first = complete(chunked, chunks=segments, return_token_ids=True)
    assert first.status_code == 200, first.text
    body = first.json()
    joined = [token for segment in segments for token in segment]
    assert body["choices"][0]["prompt_token_ids"] == joined
    again = complete(chunked, chunks=segments, return_token_ids=True).json()
    assert again["choices"][0]["token_ids"] == body["choices"][0]["token_ids"]


def test_text_and_token_id_segments_mix(servers, tokenizer) -> None:
    _, chunked = servers
    texts = complete(chunked, chunks=rag_chunks([2], "Mixed?"), return_token_ids=True)
    mixed = rag_chunks([2], "Mixed?")
    mixed[1] = tokenizer.encode(mixed[1], add_special_tokens=False)
    both = complete(chunked, chunks=mixed, return_token_ids=True)
    assert both.status_code == 200, both.text
    assert both.json()["choices"][0] == texts.json()["choices"][0]


# Ordinary prompts with "##" (issue 20): markdown headings, the seed's
# separator, must neither be refused nor chunked on a chunk-cache server.
MARKDOWN_PROMPTS = {
    # was a 400: "empty segment in a chunked prompt"
    "leading heading": "## Summary\nThe report covers sales.\n## Details\n"
    "Sales rose in the north and fell in the south.",
    # was silently chunked, with other attention (the store counted a miss)
    "heading inside": "Summarise the notes below.\n## Notes\nThe meeting moved "
    "to Friday. The budget is unchanged.",
    "prompt without headings": SYSTEM + DOCS[0] + "Which topic?",
}


@pytest.mark.parametrize("prompt", MARKDOWN_PROMPTS.values(), ids=MARKDOWN_PROMPTS)
def test_an_ordinary_prompt_is_answered_as_plain_vllm_answers_it(
    servers, prompt: str
) -> None:
    plain, chunked = servers
    lookups = chunk_lookups(chunked)
    want = complete(plain, prompt=prompt, return_token_ids=True)
    got = complete(chunked, prompt=prompt, return_token_ids=True)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0] == want.json()["choices"][0]
    assert chunk_lookups(chunked) == lookups  # the store never saw it


def test_random_prompts_with_hashes_stay_ordinary(servers, tokenizer) -> None:
    """About 1 in 5 random-token prompts contains "##" (issue 20's count with
    `vllm bench serve`'s random dataset): every one is served unchunked."""
    plain, chunked = servers
    rng = random.Random(0)
    prompts: list[str] = []
    while len(prompts) < 3:
        text = tokenizer.decode([rng.randrange(300, 4000) for _ in range(64)])
        if "##" in text:
            prompts.append(text)
    lookups = chunk_lookups(chunked)
    for prompt in prompts:
        want = complete(plain, prompt=prompt).json()["choices"][0]["text"]
        got = complete(chunked, prompt=prompt)
        assert got.status_code == 200 and got.json()["choices"][0]["text"] == want
    assert chunk_lookups(chunked) == lookups


def chunk_lookups(server: Server) -> float:
    return server.metric("vllm_kvreuse:chunk_cache_hits_total") + server.metric(
        "vllm_kvreuse:chunk_cache_misses_total"
    )


@pytest.mark.parametrize(
    "body",
    [
        {"chunks": ["a", "", "b"]},  # empty text segment
        {"chunks": ["a", [1, -2]]},
        {"chunks": ["a", 5]},
        {"chunks": [[1, 2, 3]]},  # no question
        {"chunks": [[1, 2], []]},
        {"chunks": "not a list"},
        {"chunks": [[1, 2], [3]], "prompt": "both"},
        {"chunks": [list(range(50, 1100)), [5]]},  # over the context length
    ],
)
def test_bad_chunked_input_is_400_and_the_server_keeps_serving(servers, body) -> None:
    _, chunked = servers
    response = complete(chunked, **body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"]
    assert complete(chunked, chunks=rag_chunks([0])).status_code == 200


def test_chunks_field_needs_the_flag(servers) -> None:
    plain, _ = servers
    response = complete(plain, chunks=[[1, 2], [3]])
    assert response.status_code == 400


def test_store_stats_reach_metrics(servers) -> None:
    _, chunked = servers
    complete(chunked, chunks=rag_chunks([0, 2]))
    complete(chunked, chunks=rag_chunks([2, 0]))
    assert chunked.metric("vllm_kvreuse:chunk_cache_hits_total") >= 2
    assert chunked.metric("vllm_kvreuse:chunk_cache_misses_total") >= 1
    assert chunked.metric("vllm_kvreuse:chunk_cache_chunks") >= 3
    assert chunked.metric("vllm_kvreuse:chunk_cache_device_bytes") > 0


def admin(server: Server, action: str = "", **body) -> dict:
    url = f"{server.url}/v1/kvreuse/chunk_cache" + (f"/{action}" if action else "")
    response = (
        httpx.post(url, json=body, timeout=30) if action else httpx.get(url, timeout=30)
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_admin_endpoint_pins_clears_and_reports(servers, tokenizer) -> None:
    _, chunked = servers
    complete(chunked, chunks=rag_chunks([1, 0]))
    stats = admin(chunked)
    assert stats["chunks"] >= 3 and 0.0 <= stats["hit_rate"] <= 1.0
    assert stats["device_capacity_bytes"] > stats["device_bytes"] > 0
    doc = tokenizer.encode(DOCS[1], add_special_tokens=False)
    assert admin(chunked, "pin", token_ids=doc) == {"found": True, "pinned": True}
    assert admin(chunked, "pin", token_ids=[1, 2, 3]) == {"found": False}
    assert admin(chunked, "clear")["evicted"] == stats["chunks"] - 1
    assert admin(chunked)["chunks"] == 1  # the pinned document stays
    assert admin(chunked, "unpin", token_ids=doc)["pinned"] is False
    assert admin(chunked, "clear")["evicted"] == 1
    assert admin(chunked)["chunks"] == 0
    bad = httpx.post(f"{chunked.url}/v1/kvreuse/chunk_cache/pin", json={}, timeout=30)
    assert bad.status_code in (400, 422)


def test_streaming_and_parallel_samples_work_on_chunked_prompts(servers) -> None:
    _, chunked = servers
    body = {
        "model": SERVED_MODEL, "chunks": rag_chunks([0, 1], "Stream?"),
        "max_tokens": 4, "temperature": 0.0, "stream": True,
    }  # fmt: skip
    with httpx.stream(
        "POST", f"{chunked.url}/v1/completions", json=body, timeout=120
    ) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    many = complete(chunked, chunks=rag_chunks([1, 0], "Twice?"), n=2, temperature=0.8)
    assert many.status_code == 200 and len(many.json()["choices"]) == 2


def chat(server: Server, **body) -> dict:
    body = {"model": SERVED_MODEL, "max_tokens": 6, "temperature": 0.0, **body}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_chunk_messages_is_the_chunks_completion_of_its_rendering(
    servers, tokenizer
) -> None:
    """Chat with ``chunk_messages``: every message before the last a chunk, cut
    where the chat template renders them; the same prompt tokens, answer and
    cached tokens as ``chunks`` sent to /v1/completions (the real-model and
    client side: tests/e2e/test_rag_clients.py)."""
    _, chunked = servers
    messages = [{"role": "system", "content": SYSTEM}]
    messages += [{"role": "user", "content": doc} for doc in DOCS[:2]]
    messages.append({"role": "user", "content": "Which chat topic?"})
    prefixes = [
        tokenizer.apply_chat_template(messages[:k], tokenize=False)
        for k in range(1, len(messages))
    ]
    full = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    pairs = zip(["", *prefixes], [*prefixes, full], strict=True)
    chunks = [text[len(before) :] for before, text in pairs]
    body = {"return_token_ids": True, "chunk_recompute": "none"}
    chat(chunked, messages=messages, chunk_messages=True, **body)
    by_chat = chat(chunked, messages=messages, chunk_messages=True, **body)
    by_chunks = complete(chunked, chunks=chunks, **body).json()
    assert by_chat["prompt_token_ids"] == by_chunks["choices"][0]["prompt_token_ids"]
    assert by_chat["prompt_token_ids"] == tokenizer.encode(
        full, add_special_tokens=False
    )
    assert by_chat["choices"][0]["token_ids"] == by_chunks["choices"][0]["token_ids"]
    question = tokenizer.encode(chunks[-1], add_special_tokens=False)
    assert cached(by_chat) == cached(by_chunks)
    assert cached(by_chat) >= len(by_chat["prompt_token_ids"]) - len(question)


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_chat_without_chunk_messages_is_plain_vllms(servers) -> None:
    plain, chunked = servers
    messages = [{"role": "user", "content": SYSTEM + DOCS[0] + "## Which topic?"}]
    lookups = chunk_lookups(chunked)
    want, got = (
        chat(server, messages=messages, return_token_ids=True)["choices"]
        for server in (plain, chunked)
    )
    assert got == want
    assert chunk_lookups(chunked) == lookups  # the store never saw it


def test_answer_paths_over_http_are_order_free_and_a_path_of_plain_vllm(
    servers, tokenizer
) -> None:
    """``chunk_attention: "paths"`` (per request, on completions and chat):
    the answer is plain vLLM's on one document's path, whatever the order,
    and a reorder finds that path's prefix cached."""
    plain, chunked = servers
    system, question, *docs = (
        tokenizer.encode(text, add_special_tokens=False)
        for text in (SYSTEM, " Which topic is fact 1 about?", *DOCS)
    )
    paths = [
        complete(plain, prompt=system + doc + question).json()["choices"][0]["text"]
        for doc in docs
    ]
    body = {"chunk_attention": "paths"}
    first = complete(chunked, chunks=[system, *docs, question], **body).json()
    reordered = complete(
        chunked, chunks=[system, *reversed(docs), question], **body
    ).json()
    assert first["choices"][0]["text"] == reordered["choices"][0]["text"]
    assert first["choices"][0]["text"] in paths
    assert cached(reordered) >= BLOCK_SIZE
    messages = [{"role": "user", "content": text} for text in [*DOCS, "Which?"]]
    by_chat = chat(chunked, messages=messages, chunk_messages=True, **body)
    assert by_chat["choices"][0]["message"]["content"] is not None


@pytest.mark.parametrize("mode", ["joint", "paths", "choose"])
def test_a_conversations_turns_are_never_cut(servers, mode: str) -> None:
    """A multi-turn chat with ``chunk_messages`` in each mode: the documents
    are the messages before the first assistant turn; that turn and the
    question stand in every path. ``joint`` answers as plain vLLM on the
    whole conversation; ``paths`` as plain vLLM on one document and the
    turns; ``choose`` (default margin and k) on one or both documents, in
    order, with the turns; the response says how many it kept."""
    plain, chunked = servers
    system = {"role": "system", "content": SYSTEM}
    # Documents no other test sends: new to the store, computed in place.
    docs = [{"role": "user", "content": f"{text} (a chat)"} for text in DOCS[:2]]
    turns = [
        {"role": "assistant", "content": "Fact 1 is about topic 7."},
        {"role": "user", "content": "And which topic is fact 0 about?"},
    ]

    def plain_answer(kept: list[dict]) -> str:
        body = chat(plain, messages=[system, *kept, *turns])
        return body["choices"][0]["message"]["content"]

    body = chat(chunked, messages=[system, *docs, *turns], chunk_messages=True,
                chunk_attention=mode)  # fmt: skip
    answer = body["choices"][0]["message"]["content"]
    kept = (body.get("kv_transfer_params") or {}).get("kvreuse_documents_kept")
    if mode == "joint":
        assert answer == plain_answer(docs) and kept is None
    elif mode == "paths":
        assert kept == 1 and answer in {plain_answer([doc]) for doc in docs}
    else:
        expected = {1: {plain_answer([doc]) for doc in docs}, 2: {plain_answer(docs)}}
        assert kept in expected and answer in expected[kept]
