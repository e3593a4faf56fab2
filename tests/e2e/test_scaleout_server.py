"""Every feature on `vllm serve --data-parallel-size 2 --api-server-count 2`.

Requests go through keep-alive connections pinned to each API-server process
(:mod:`vllm_kvreuse.testing.processes`), so a test proves a child crossed
processes; a child's cached tokens prove it ran on the DP rank holding its
parent's blocks (the other rank has never seen its tokens). Extra topologies
(``--api-server-count 2`` alone, more ranks) are opt-in: ``--scaleout-args``.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator

import pytest

from tests.conftest import BLOCK_SIZE
from tests.e2e.conftest import SERVED_MODEL, Server
from vllm_kvreuse.testing.processes import PinnedConnection, pinned_connections

pytestmark = [
    pytest.mark.e2e,
    # Four vLLM processes on two cores; through the interpreted V2 runner
    # their start-up and steps would take most of CI's V2 budget. The
    # topology code (settings, routing, look-ups) is frontend and engine
    # core, the same under both runners.
    pytest.mark.v1_only("CI time: two DP engines and two API servers"),
]

ITEMS = [(100, 1200, 2300), (100, 1200, 2301), (101, 1201, 2302), (108, 1301, 2401)]
TOPOLOGY = "--data-parallel-size 2 --api-server-count 2"


def topology(config: pytest.Config) -> list[str]:
    return shlex.split(config.getoption("--scaleout-args") or TOPOLOGY)


def data_parallel_size(flags: list[str]) -> int:
    name = "--data-parallel-size"
    return int(flags[flags.index(name) + 1]) if name in flags else 1


@pytest.fixture(scope="module")
def server(model_dir: str, tmp_path_factory, request) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("scaleout")
    catalog = folder / "items.txt"
    lines = ["# sid-catalog v1", "# layout: tokens"]
    catalog.write_text("\n".join(lines + [" ".join(map(str, i)) for i in ITEMS]))
    with Server(
        model_dir, *topology(request.config),
        "--enable-continuation", "--retain-kv-ttl", "3",
        "--global-cache-hit-threshold", "0", "--engine-beam-search",
        "--sid-catalog", str(catalog), "--logprobs-mode", "processed_logprobs",
        "--enable-chunk-cache",
        log_path=folder / "server.log", block_size=BLOCK_SIZE,
        # Connections stay with their process for the whole module.
        env={"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "600"},
        ready_timeout=900,  # four processes import vLLM on two cores
    ) as srv:  # fmt: skip
        yield srv


@pytest.fixture(scope="module")
def conns(server: Server) -> Iterator[list[PinnedConnection]]:
    held = pinned_connections(server.url, server.process.pid, 2)
    yield held
    for conn in held:
        conn.close()


def prompt(seed: int, n: int = 70) -> list[int]:
    return [(seed * 131 + 7 * i) % 3000 + 60 for i in range(n)]


def ok(reply: tuple[int, object, int | None]) -> dict:
    status, body, _ = reply
    assert status == 200, body
    assert isinstance(body, dict)
    return body


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_fifty_pairs_across_processes_and_ranks(
    server: Server, conns, pytestconfig: pytest.Config
) -> None:
    """Parent on one API server, child on the other, alternating: 0 failures,
    and every child inherits its parent's blocks on the parent's rank."""
    for i in range(50):
        first, second = conns if i % 2 == 0 else conns[::-1]
        status, parent, parent_pid = first.post(
            "/v1/completions",
            {"model": SERVED_MODEL, "prompt": prompt(i), "max_tokens": 4,
             "temperature": 0.0, "retain_kv": True, "return_token_ids": True},
        )  # fmt: skip
        assert status == 200, parent
        status, child, child_pid = second.post(
            "/v1/completions",
            {"model": SERVED_MODEL, "continuation_of": parent["id"],
             "continuation_suffix_token_ids": [5, 6], "max_tokens": 2,
             "temperature": 0.0},
        )  # fmt: skip
        assert status == 200, (i, child)
        assert parent_pid != child_pid
        choice = parent["choices"][0]
        inherited = len(choice["prompt_token_ids"]) + len(choice["token_ids"]) - 1
        assert cached(child) == inherited, (i, child["usage"])
    # Every rank served parents: each runs the plugin's scheduler.
    for rank in range(data_parallel_size(topology(pytestconfig))):
        assert server.metric("vllm:prompt_tokens_total", f'engine="{rank}"') > 0


def test_chat_streaming_and_n_across_processes(conns) -> None:
    a, b = conns
    parent = ok(a.post(
        "/v1/chat/completions",
        {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "Hi there"}],
         "max_tokens": 4, "n": 2, "temperature": 1.0, "retain_kv": True},
    ))  # fmt: skip
    status, events, _ = b.post(
        "/v1/chat/completions",
        {"model": SERVED_MODEL, "messages": [], "continuation_of": parent["id"],
         "continuation_choice": 1, "max_tokens": 3, "stream": True,
         "stream_options": {"include_usage": True}},
    )  # fmt: skip
    assert status == 200, events
    assert cached(events[-1]) > 0
    status, events, _ = b.post(
        "/v1/completions",
        {"model": SERVED_MODEL, "prompt": prompt(900), "max_tokens": 3,
         "stream": True, "retain_kv": True},
    )  # fmt: skip
    child = ok(a.post(
        "/v1/completions",
        {"model": SERVED_MODEL, "continuation_of": events[0]["id"],
         "max_tokens": 2},
    ))  # fmt: skip
    assert cached(child) >= 64


def test_unknown_and_other_tenant_parents_are_404_everywhere(conns) -> None:
    a, b = conns
    parent = ok(a.post(
        "/v1/completions",
        {"model": SERVED_MODEL, "prompt": prompt(901), "max_tokens": 2,
         "retain_kv": True, "cache_salt": "tenant-a"},
    ))  # fmt: skip
    for conn in (a, b):
        status, body, _ = conn.post(
            "/v1/completions",
            {"model": SERVED_MODEL, "continuation_of": parent["id"],
             "max_tokens": 2, "cache_salt": "tenant-b"},
        )  # fmt: skip
        assert status == 404 and body["error"]["param"] == "continuation_of"
        status, body, _ = conn.post(
            "/v1/completions",
            {"model": SERVED_MODEL, "continuation_of": "cmpl-forged", "max_tokens": 2},
        )
        assert status == 404


def test_engine_beam_search_catalog_threshold_chunks_on_each_process(conns) -> None:
    a, b = conns
    stage1 = ok(a.post(
        "/v1/completions",
        {"model": SERVED_MODEL, "prompt": prompt(902, 90), "max_tokens": 6,
         "temperature": 0.0, "retain_kv": True, "return_token_ids": True},
    ))  # fmt: skip
    beams = ok(b.post(
        "/v1/completions",
        {"model": SERVED_MODEL, "continuation_of": stage1["id"],
         "continuation_suffix_token_ids": [3, 4, 5], "use_beam_search": True,
         "n": 4, "max_tokens": 3},
    ))  # fmt: skip
    choice = stage1["choices"][0]
    full = len(choice["prompt_token_ids"]) + len(choice["token_ids"]) + 3
    assert len(beams["choices"]) == 4
    assert cached(beams) == full - 3 - 1  # the root inherited on the parent's rank
    for index, conn in enumerate((a, b)):
        items = ok(conn.post(
            "/v1/completions",
            {"model": SERVED_MODEL, "prompt": prompt(903), "max_tokens": 3,
             "use_beam_search": True, "n": 4, "sid_catalog": True,
             "return_token_ids": True},
        ))  # fmt: skip
        assert sorted(tuple(c["token_ids"]) for c in items["choices"]) == ITEMS
        rejected = ok(conn.post(
            "/v1/completions",
            {"model": SERVED_MODEL, "prompt": prompt(904 + index),
             "max_tokens": 2, "cache_hit_threshold": 0.9},
        ))  # fmt: skip
        assert rejected["choices"][0]["finish_reason"] == "cache_threshold"
    rag = "##".join(["You answer. " * 8, "Doc one is long. " * 12, "Which?"])
    cold = ok(
        a.post(
            "/v1/completions",
            {"model": SERVED_MODEL, "prompt": rag, "max_tokens": 3, "temperature": 0.0},
        )
    )
    warm = ok(
        b.post(
            "/v1/completions",
            {"model": SERVED_MODEL, "prompt": rag, "max_tokens": 3, "temperature": 0.0},
        )
    )
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]


def test_chunked_parent_across_processes(conns) -> None:
    """The chunk cache rehashes a chunked request under a salt of its own;
    the engine's record still answers to the client's salt (none here)."""
    a, b = conns
    rag = "##".join(["System words. " * 8, "A document here. " * 12, "Q?"])
    parent = ok(a.post(
        "/v1/completions",
        {"model": SERVED_MODEL, "prompt": rag, "max_tokens": 4,
         "temperature": 0.0, "retain_kv": True},
    ))  # fmt: skip
    child = ok(b.post(
        "/v1/completions",
        {"model": SERVED_MODEL, "continuation_of": parent["id"],
         "continuation_suffix_token_ids": [5], "max_tokens": 2},
    ))  # fmt: skip
    assert cached(child) > 0
