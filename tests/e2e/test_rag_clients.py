"""The chunk cache behind /v1/chat/completions, driven by the clients RAG
applications use: the openai SDK (streamed and not), LangChain's
``ChatOpenAI`` and LlamaIndex's ``OpenAILike`` (run in its own environment,
``.venv/llamaindex``: see scripts/setup.sh), against a real ``vllm serve``
of SmolLM2-135M-Instruct with ``--enable-chunk-cache`` and a plain server of
the same model. The snippets of docs/rag_frameworks.md's "RAG from your
framework" run as printed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import ROOT
from tests.e2e.conftest import SERVED_MODEL, Server
from vllm_kvreuse.testing.server_group import ServerSpec, started_together

pytestmark = [
    pytest.mark.e2e,
    # Two servers of the 30-layer model: through the interpreted V2 runner
    # that would cost most of CI's V2 budget. The V2 tier runs chunked chat
    # on the tiny model (test_chunk_cache_server.py, test_hostile_bodies.py).
    pytest.mark.v1_only("CI time: serves the 135M model twice"),
]

SEP = "\n<doc>\n"
SYSTEM = "Answer the question from the documents."
TOWER = "The Kelmar Tower is in Lisbon. It is 120 metres tall."
BRIDGE = "The Vantor Bridge is in Oslo. It was built in 1873."
ASK_TOWER = "In which city is the Kelmar Tower?"
ASK_BRIDGE = "When was the Vantor Bridge built?"
QUESTION_TOKENS = 24
"""More than a question and the generation prompt take: the part of a
chunked prompt that is never loaded."""
LLAMAINDEX = ROOT / ".venv" / "llamaindex"


@pytest.fixture(scope="module")
def servers(smollm2_dir: str, tmp_path_factory) -> Iterator[tuple[Server, Server]]:
    """A plain server and a chunk-cache server (with the separator, chat
    templates from requests for ``documents``, and continuations)."""
    logs = tmp_path_factory.mktemp("rag")
    chunk_flags = [
        *("--enable-chunk-cache", "--chunk-separator", SEP),
        *("--enable-continuation", "--trust-request-chat-template"),
    ]
    specs = [
        ServerSpec("plain", smollm2_dir),
        ServerSpec("chunked", smollm2_dir, chunk_flags),
    ]
    with started_together(specs, logs) as (plain, chunked):
        yield plain, chunked


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def rag_messages(documents: list[str], question: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        *({"role": "user", "content": f"Document: {doc}"} for doc in documents),
        {"role": "user", "content": question},
    ]


def chat(server: Server, **body: Any) -> dict[str, Any]:
    body = {"model": SERVED_MODEL, "max_tokens": 16, "temperature": 0, **body}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def cached(body: dict[str, Any]) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def openai_client(server: Server) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


# -- the openai SDK -------------------------------------------------------------


def test_openai_sdk_streamed_and_not(servers) -> None:
    """Answers from the documents (the server's recompute settings), streamed
    as not; a reorder is found in the store (with nothing recomputed: all
    but the question; such isolated chunks may answer wrongly, see
    docs/chunk_cache.md)."""
    _, chunked = servers
    client = openai_client(chunked)
    kwargs: dict[str, Any] = dict(model=SERVED_MODEL, max_tokens=16, temperature=0)
    switch = {"chunk_messages": True}
    messages = rag_messages([TOWER, BRIDGE], ASK_TOWER)
    first = client.chat.completions.create(
        messages=messages, extra_body=switch, **kwargs
    )
    assert "Lisbon" in first.choices[0].message.content
    stream = client.chat.completions.create(
        messages=messages, stream=True, extra_body=switch, **kwargs
    )
    text = "".join(e.choices[0].delta.content or "" for e in stream if e.choices)
    assert text == first.choices[0].message.content
    swapped = client.chat.completions.create(
        messages=rag_messages([BRIDGE, TOWER], ASK_BRIDGE), stream=True,
        stream_options={"include_usage": True},
        extra_body={**switch, "chunk_recompute": "none"}, **kwargs,
    )  # fmt: skip
    usage = list(swapped)[-1].usage
    loaded = usage.prompt_tokens_details.cached_tokens
    assert loaded >= usage.prompt_tokens - QUESTION_TOKENS


def test_openai_sdk_without_the_switch_is_plain_vllm(servers) -> None:
    """Documents as messages, some holding markdown and blank lines, no
    separator: every token as a plain server gives it."""
    plain, chunked = servers
    notes = "## Notes\n\nThe bridge is old.\n\n" + BRIDGE
    messages = rag_messages([TOWER, notes], ASK_BRIDGE)
    answers = [
        openai_client(server).chat.completions.create(
            model=SERVED_MODEL, messages=messages, max_tokens=16, temperature=0,
            logprobs=True, extra_body={"return_token_ids": True},
        ).model_dump()
        for server in (plain, chunked)
    ]  # fmt: skip
    for answer in answers:  # prompt_tokens_details: each server's prefix cache;
        # the fingerprint hashes the server's config, which the flags change
        del answer["id"], answer["created"], answer["system_fingerprint"]
        del answer["usage"]["prompt_tokens_details"]
    assert answers[0] == answers[1]


def test_chunk_messages_equals_the_chunks_completion(servers, tokenizer) -> None:
    """The same chunks as ``chunks`` on /v1/completions: the same prompt
    tokens, answer and cached tokens (both warm)."""
    _, chunked = servers
    messages = rag_messages([BRIDGE, TOWER], ASK_BRIDGE)
    rendered = [
        tokenizer.apply_chat_template(messages[:k], tokenize=False)
        for k in range(1, len(messages))
    ]
    full = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    chunks = [
        b[len(a) :] for a, b in zip(["", *rendered], [*rendered, full], strict=True)
    ]
    body = {"return_token_ids": True}
    chat(chunked, messages=messages, chunk_messages=True, **body)  # cold
    by_chat = chat(chunked, messages=messages, chunk_messages=True, **body)
    completion = {"model": SERVED_MODEL, "max_tokens": 16, "temperature": 0, **body}
    response = httpx.post(
        f"{chunked.url}/v1/completions",
        json={**completion, "chunks": chunks},
        timeout=120,
    )
    by_chunks = response.json()
    assert by_chat["prompt_token_ids"] == by_chunks["choices"][0]["prompt_token_ids"]
    assert by_chat["choices"][0]["token_ids"] == by_chunks["choices"][0]["token_ids"]
    assert cached(by_chat) == cached(by_chunks) > 0
    assert "1873" in by_chat["choices"][0]["message"]["content"]
    # return_token_ids: exactly what the chat template renders for the messages
    assert by_chat["prompt_token_ids"] == tokenizer.encode(
        full, add_special_tokens=False
    )


def test_n_logprobs_and_a_continuation_of_a_chunked_chat(servers) -> None:
    _, chunked = servers
    messages = rag_messages([TOWER, BRIDGE], ASK_TOWER)
    parent = chat(  # n > 1 needs sampling; top_k 1 keeps it greedy
        chunked, messages=messages, chunk_messages=True, n=2, temperature=1.0,
        top_k=1, logprobs=True, top_logprobs=2, retain_kv=True, retain_kv_ttl=2,
    )  # fmt: skip
    first, second = parent["choices"]
    assert first["message"]["content"] == second["message"]["content"]
    assert len(first["logprobs"]["content"][0]["top_logprobs"]) == 2
    # The parent's turn ends with <|im_end|> if it stopped, else the suffix ends it.
    end = "" if first["finish_reason"] == "stop" else "<|im_end|>"
    suffix = f"{end}\n<|im_start|>user\n{ASK_BRIDGE}<|im_end|>\n<|im_start|>assistant\n"
    child = chat(
        chunked, messages=[], continuation_of=parent["id"], continuation_suffix=suffix
    )
    assert "1873" in child["choices"][0]["message"]["content"]
    assert cached(child) >= parent["usage"]["prompt_tokens"]


# -- vLLM's documents field ---------------------------------------------------------

# SmolLM2's template with vLLM's `documents` in the system turn, one each.
DOCUMENTS_TEMPLATE = (
    "<|im_start|>system\n{{ messages[0]['content'] }}"
    "{% for d in documents %}\nDocument: {{ d['text'] }}{% endfor %}<|im_end|>\n"
    "{% for m in messages[1:] %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


def test_documents_are_chunked_where_the_template_renders_them(servers) -> None:
    _, chunked = servers
    body = {"messages": rag_messages([], ASK_BRIDGE), "chunk_messages": True}
    docs = [{"title": "tower", "text": TOWER}, {"title": "bridge", "text": BRIDGE}]
    first = chat(chunked, **body, documents=docs, chat_template=DOCUMENTS_TEMPLATE)
    assert "1873" in first["choices"][0]["message"]["content"]
    swapped = chat(
        chunked, **body, documents=docs[::-1], chat_template=DOCUMENTS_TEMPLATE,
        chunk_recompute="none",
    )  # fmt: skip
    assert cached(swapped) >= swapped["usage"]["prompt_tokens"] - QUESTION_TOKENS
    # SmolLM2's own template ignores documents: refused, not silently dropped.
    ignored = httpx.post(
        f"{chunked.url}/v1/chat/completions",
        json={"model": SERVED_MODEL, **body, "documents": docs}, timeout=120,
    )  # fmt: skip
    assert (
        ignored.status_code == 400 and "ignores" in ignored.json()["error"]["message"]
    )


# -- LangChain and LlamaIndex ---------------------------------------------------


def test_langchain_chat_openai_messages(servers) -> None:
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    plain, chunked = servers

    def llm(server: Server, **extra: Any) -> Any:
        return ChatOpenAI(
            model=SERVED_MODEL, base_url=f"{server.url}/v1", api_key="unused",
            temperature=0, max_tokens=16, max_retries=0, extra_body=extra or None,
        )  # fmt: skip

    def messages(documents: list[str], question: str) -> list[Any]:
        return [
            SystemMessage(SYSTEM),
            *(HumanMessage(f"Document: {doc}") for doc in documents),
            HumanMessage(question),
        ]

    chunking = llm(chunked, chunk_messages=True)
    assert "Lisbon" in chunking.invoke(messages([TOWER, BRIDGE], ASK_TOWER)).content
    loading = llm(chunked, chunk_messages=True, chunk_recompute="none")
    usage = loading.invoke(messages([BRIDGE, TOWER], ASK_BRIDGE)).usage_metadata
    loaded = usage["input_token_details"]["cache_read"]
    assert loaded >= usage["input_tokens"] - QUESTION_TOKENS
    unswitched = messages([TOWER, BRIDGE], "Which is taller, the tower or the bridge?")
    want, got = (llm(server).invoke(unswitched) for server in (plain, chunked))
    assert got.content == want.content


LLAMAINDEX_PLAIN = """
from llama_index.core.llms import ChatMessage
from llama_index.llms.openai_like import OpenAILike
import json, sys

model, messages, *urls = sys.argv[1:]
messages = [ChatMessage(**message) for message in json.loads(messages)]
for url in urls:
    llm = OpenAILike(model=model, api_base=url, api_key="unused",
                     is_chat_model=True, temperature=0, max_tokens=16)
    print(json.dumps(llm.chat(messages).raw.choices[0].message.content))
"""


def run_llamaindex(code: str, *args: str) -> str:
    """``code`` run in LlamaIndex's own environment; its stdout."""
    assert (LLAMAINDEX / "llama_index").is_dir(), (
        f"{LLAMAINDEX} is missing: run bash scripts/setup.sh"
    )
    env = {**os.environ, "PYTHONPATH": str(LLAMAINDEX)}
    done = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_llamaindex_without_the_switch_is_plain_vllm(servers) -> None:
    messages = json.dumps(rag_messages([TOWER, BRIDGE], ASK_TOWER))
    urls = [f"{server.url}/v1" for server in servers]
    output = run_llamaindex(LLAMAINDEX_PLAIN, SERVED_MODEL, messages, *urls)
    want, got = output.splitlines()
    assert got == want and "Lisbon" in got


def doc_snippets() -> list[str]:
    """The python blocks of docs/rag_frameworks.md's "RAG from your framework"."""
    text = (ROOT / "docs" / "rag_frameworks.md").read_text()
    section = text.split("## RAG from your framework", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.DOTALL)


@pytest.mark.parametrize("framework", ["openai", "langchain", "llamaindex"])
def test_the_docs_snippets_run_as_printed(servers, framework: str) -> None:
    _, chunked = servers
    names = ["openai", "langchain", "llamaindex"]
    code = dict(zip(names, doc_snippets(), strict=True))[framework]
    code = code.replace("http://localhost:8000", chunked.url)
    code = code.replace('"smollm2"', f'"{SERVED_MODEL}"')
    if framework == "llamaindex":
        output = run_llamaindex(code)
    else:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        output = done.stdout
    first, second, tokens = output.strip().splitlines()
    assert "Lisbon" in first and "1873" in second, output
    assert int(tokens.removeprefix("cached_tokens: ")) > 0, output
