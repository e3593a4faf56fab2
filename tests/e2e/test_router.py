"""Two `vllm serve` instances behind `vllm-router` (vllm-project/router).

Each instance keeps its parents to itself (docs/deployment.md, "Behind a
router"), so a child must reach its parent's instance. With
``--policy consistent_hash`` and an ``X-Session-ID`` header on the parent and
its children it does; without the header a child is routed on its own and
may land on the other instance (404). The router's per-worker counter
(``vllm_router_processed_requests_total``) says where each request went.

Both share one chunk store (a real Valkey server): a document one computes
the other loads; with the store killed, both compute and answer the same.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BLOCK_SIZE
from tests.e2e.conftest import SERVED_MODEL, Server
from vllm_kvreuse.testing.router import ROUTER, Router
from vllm_kvreuse.testing.server_group import ServerSpec, started_together
from vllm_kvreuse.testing.valkey import ValkeyServer

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not Path(ROUTER).exists(),
        reason=f"no vllm-router binary at {ROUTER}: pip install 'vllm-router==0.1.17' "
        "(in the [test] extra)",
    ),
    # Two engines through the interpreted V2 runner would take most of CI's
    # V2 budget; routing is frontend-only, the same under both runners.
    pytest.mark.v1_only("CI time: two servers; the router is runner-independent"),
]

EVERY_FEATURE = [
    "--enable-continuation", "--engine-beam-search", "--enable-chunk-cache",
    "--global-cache-hit-threshold", "0",
    # Parents stay addressable through a session's three children on a
    # loaded machine, and expire within the leak check's 10 s wait.
    "--retain-kv-ttl", "5",
    "--max-model-len", "512", "--num-gpu-blocks-override", "64",
]  # fmt: skip
MIN_SESSIONS, MAX_SESSIONS = 6, 24


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Iterator[ValkeyServer]:
    log = tmp_path_factory.mktemp("valkey") / "valkey.log"
    with ValkeyServer(log_path=log, maxmemory_mib=256) as server:
        yield server


@pytest.fixture(scope="module")
def servers(
    model_dir: str, store: ValkeyServer, tmp_path_factory
) -> Iterator[tuple[Server, Server]]:
    logs = tmp_path_factory.mktemp("router")
    args = [*EVERY_FEATURE, "--chunk-cache-remote-url", store.url]
    specs = [ServerSpec(name, model_dir, args, block_size=BLOCK_SIZE) for name in "ab"]
    with started_together(specs, logs, ready_timeout=300) as (a, b):
        yield a, b


def start_router(servers: tuple[Server, Server], policy: str, tmp_path_factory):
    log = tmp_path_factory.mktemp("router") / f"vllm-router-{policy}.log"
    return Router([s.url for s in servers], policy, log_path=log)


@pytest.fixture(scope="module")
def hashed(servers, tmp_path_factory) -> Iterator[Router]:
    with start_router(servers, "consistent_hash", tmp_path_factory) as router:
        yield router


@pytest.fixture(scope="module")
def round_robin(servers, tmp_path_factory) -> Iterator[Router]:
    with start_router(servers, "round_robin", tmp_path_factory) as router:
        yield router


def send(
    router: Router, path: str, body: dict[str, Any], session: str | None = None
) -> tuple[int, Any, str]:
    """(status, reply, URL of the worker the router sent the request to)."""
    before = router.routed()
    status, reply = router.post(path, body, session)
    after = router.routed()
    moved = {url: n - before.get(url, 0) for url, n in after.items()}
    workers = [url for url, n in moved.items() if n]
    assert len(workers) == 1 and moved[workers[0]] == 1, (before, after)
    return status, reply, workers[0]


def parent_body(seed: int, length: int = 70) -> dict[str, Any]:
    tokens = [(seed * 131 + 7 * i) % 3000 + 60 for i in range(length)]
    return {
        "model": SERVED_MODEL, "prompt": tokens, "max_tokens": 4,
        "temperature": 0.0, "retain_kv": True, "return_token_ids": True,
    }  # fmt: skip


def children(parent_id: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """A completion child, a chat child and stage 2 of a two-stage beam call.

    vllm-router reads the body as a typed request whose ``prompt`` (or
    ``messages``) is required: a child sends it empty, as the plugin allows.
    """
    child = {"model": SERVED_MODEL, "continuation_of": parent_id, "max_tokens": 2}
    return {
        "completion": (
            "/v1/completions",
            {**child, "prompt": "", "continuation_suffix_token_ids": [5, 6]},
        ),
        "chat": (
            "/v1/chat/completions",
            {**child, "messages": [], "continuation_suffix_token_ids": [5, 6]},
        ),
        "beams": (
            "/v1/completions",
            {**child, "prompt": "", "continuation_suffix_token_ids": [3, 4, 5],
             "use_beam_search": True, "n": 4, "max_tokens": 3},
        ),
    }  # fmt: skip


def inherited(parent: dict[str, Any]) -> int:
    """Tokens a child of ``parent`` takes from its retained blocks: all but
    the last sampled one, which has no KV yet."""
    choice = parent["choices"][0]
    return len(choice["prompt_token_ids"]) + len(choice["token_ids"]) - 1


def session_failures(router: Router, seed: int, session: str) -> tuple[str, list]:
    """Runs one session (parent, then its three children); returns the
    parent's worker and what went wrong."""
    status, parent, home = send(router, "/v1/completions", parent_body(seed), session)
    assert status == 200, parent
    failures = []
    for kind, (path, body) in children(parent["id"]).items():
        status, reply, worker = send(router, path, body, session)
        if status != 200 or worker != home:
            failures.append((session, kind, status, worker, home, reply))
            continue
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        if cached != inherited(parent):
            failures.append((session, kind, "cached", cached, inherited(parent)))
        elif kind == "beams" and len(reply["choices"]) != 4:
            failures.append((session, kind, "beams", len(reply["choices"])))
    return home, failures


def test_session_header_keeps_children_with_their_parent(servers, hashed) -> None:
    """consistent_hash + X-Session-ID: every child and every two-stage beam
    call reaches its parent's server and inherits its blocks, 0 failures;
    sessions are spread over both servers."""
    per_server: Counter[str] = Counter()
    failures: list = []
    for seed in range(MAX_SESSIONS):
        # Session ids map to servers by a hash of each server's URL (a free
        # port): run sessions until both servers have had two.
        if (
            seed >= MIN_SESSIONS
            and len(per_server) == 2
            and min(per_server.values()) >= 2
        ):
            break
        home, failed = session_failures(hashed, seed, f"session-{seed}")
        per_server[home] += 1
        failures += failed
    assert failures == [], failures
    assert len(per_server) == 2, per_server


def unrouted_pair(
    router: Router, seed: int, length: int = 70
) -> tuple[int, Any, str, str]:
    """A parent and one child, no header: (child status, reply, the parent's
    worker, the child's worker)."""
    status, parent, home = send(router, "/v1/completions", parent_body(seed, length))
    assert status == 200, parent
    path, body = children(parent["id"])["completion"]
    status, reply, worker = send(router, path, body)
    return status, reply, home, worker


def test_without_the_header_round_robin_splits_every_pair(servers, round_robin) -> None:
    """The failure mode docs/deployment.md warns about, deterministically:
    round_robin sends each child to the other server, which answers 404."""
    for seed in range(100, 103):
        status, reply, home, worker = unrouted_pair(round_robin, seed)
        assert worker != home
        assert status == 404, reply
        assert reply["error"]["param"] == "continuation_of"


def test_without_the_header_consistent_hash_routes_children_alike(
    servers, hashed
) -> None:
    """With no session key, consistent_hash hashes the prompt's text; a
    token prompt's text is ``token_ids:<count>`` and a child's is empty. So
    every child goes to one server whatever its parent, and a child whose
    parent's prompt length hashed to the other server gets 404 (lengths are
    tried until one does: 16 all on one server has odds 2**-16)."""
    child_servers, statuses = set(), []
    for length in range(60, 76):
        status, reply, home, worker = unrouted_pair(hashed, length, length)
        assert status == (200 if worker == home else 404), (home, worker, reply)
        child_servers.add(worker)
        statuses.append(status)
        if 404 in statuses:
            break
    assert len(child_servers) == 1, child_servers
    assert 404 in statuses, statuses


def rag_body(first: int) -> dict[str, Any]:
    """A chunked prompt: a system prompt, two documents of their own, a
    question (and the empty ``prompt`` vllm-router requires)."""
    system, question = list(range(100, 140)), list(range(400, 410))
    documents = [list(range(first + 80 * n, first + 80 * n + 70)) for n in (0, 1)]
    return {
        "model": SERVED_MODEL, "prompt": "", "chunks": [system, *documents, question],
        "max_tokens": 6, "temperature": 0.0, "logprobs": 2,
    }  # fmt: skip


def remote_hits(servers: tuple[Server, Server]) -> float:
    return sum(s.metric("vllm_kvreuse:chunk_cache_remote_hits_total") for s in servers)


def test_a_document_one_server_computed_the_other_loads(servers, round_robin) -> None:
    """round_robin alternates: the second server finds the first one's
    documents in the shared store and answers as the first did."""
    hits = remote_hits(servers)
    status, first, computed_on = send(round_robin, "/v1/completions", rag_body(1000))
    assert status == 200, first
    status, second, loaded_on = send(round_robin, "/v1/completions", rag_body(1000))
    assert status == 200, second
    assert loaded_on != computed_on
    assert remote_hits(servers) - hits >= 2  # both documents
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert second["choices"][0]["logprobs"] == first["choices"][0]["logprobs"]


def test_with_the_store_killed_every_request_is_answered(
    servers, round_robin, store
) -> None:
    """The shared store dies mid-run: servers compute what they would have
    loaded, answer 200 and as an ordinary prompt is answered (last in this
    module: the store stays dead)."""
    status, _, _ = send(round_robin, "/v1/completions", rag_body(1400))
    assert status == 200
    store.kill()
    for first in (1400, 1800, 1400):
        body = rag_body(first)
        status, reply, _ = send(round_robin, "/v1/completions", body)
        assert status == 200, reply
        chunks = body.pop("chunks")
        plain = {**body, "prompt": [t for chunk in chunks for t in chunk]}
        body["chunks"] = chunks
        status, ordinary, _ = send(round_robin, "/v1/completions", plain)
        assert status == 200, ordinary
        assert reply["choices"][0]["text"] == ordinary["choices"][0]["text"]
