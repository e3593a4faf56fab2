"""The chunk cache over HTTP: `vllm serve --enable-chunk-cache` and the openai
client, against a plain server of the same model."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import BLOCK_SIZE
from tests.e2e.conftest import SERVED_MODEL, Server

pytestmark = pytest.mark.e2e

SYSTEM = "You answer from the documents. " * 6
DOCS = [f"Document {n}: " + f"fact {n} is about topic {n * 7}. " * 12 for n in range(3)]


@pytest.fixture(scope="module")
def servers(model_dir: str, tmp_path_factory) -> Iterator[tuple[Server, Server]]:
    logs = tmp_path_factory.mktemp("chunks")
    plain = Server(model_dir, log_path=logs / "plain.log", block_size=BLOCK_SIZE)
    try:
        chunked = Server(
            model_dir, "--enable-chunk-cache", log_path=logs / "chunked.log",
            block_size=BLOCK_SIZE,
        )  # fmt: skip
    except Exception:
        plain.close()
        raise
    yield plain, chunked
    chunked.close()
    plain.close()


def complete(server: Server, **body) -> httpx.Response:
    body = {"model": SERVED_MODEL, "max_tokens": 6, "temperature": 0.0, **body}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)


def rag_prompt(order: list[int], question: str = "Which topic?") -> str:
    return "##".join([SYSTEM, *(DOCS[n] for n in order), question])


def test_cold_and_warm_give_the_same_answer_and_warm_is_cached(servers) -> None:
    _, chunked = servers
    cold = complete(chunked, prompt=rag_prompt([0, 1]), return_token_ids=True).json()
    warm = complete(chunked, prompt=rag_prompt([0, 1]), return_token_ids=True).json()
    assert warm["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= warm["usage"]["prompt_tokens"] - 8  # all but the question
    # return_token_ids: the concatenated segments, no separator tokens.
    assert "##" not in chunked_text(chunked, warm["choices"][0]["prompt_token_ids"])


def chunked_text(server: Server, token_ids: list[int]) -> str:
    response = httpx.post(
        f"{server.url}/detokenize",
        json={"model": SERVED_MODEL, "tokens": token_ids},
        timeout=30,
    )
    return response.json()["prompt"]


def test_reordered_documents_reuse_their_chunks(servers) -> None:
    _, chunked = servers
    complete(chunked, prompt=rag_prompt([1, 2]))
    swapped = complete(chunked, prompt=rag_prompt([2, 1], "Another question?"))
    assert swapped.status_code == 200
    usage = swapped.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 8


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


def test_a_prompt_without_separator_is_plain_vllm(servers) -> None:
    plain, chunked = servers
    prompt = SYSTEM + DOCS[0] + "Which topic?"
    want = complete(plain, prompt=prompt).json()["choices"][0]["text"]
    assert complete(chunked, prompt=prompt).json()["choices"][0]["text"] == want


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "a####b"},  # empty segment
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
    assert complete(chunked, prompt=rag_prompt([0])).status_code == 200


def test_chunks_field_needs_the_flag(servers) -> None:
    plain, _ = servers
    response = complete(plain, chunks=[[1, 2], [3]])
    assert response.status_code == 400
