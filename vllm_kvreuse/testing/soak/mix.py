"""The soak's client: a seeded random mix of every kind of request the plugin
serves, sent by concurrent workers over one ``httpx.AsyncClient``.

Kinds (:data:`WEIGHTS`):

- ``plain``, ``stream``: completions, plain or RAG prompt, streamed or not;
- ``abandon``: a stream the client closes after 0-3 chunks (0: as soon as
  the headers arrive, so the request may still be waiting for its chunks);
- ``chain``: stage 1 with ``retain_kv`` and a short ``retain_kv_ttl``, then
  stage 2 with ``continuation_of`` and ``continuation_suffix``;
  ``chain_beam`` makes stage 2 an engine beam search of width 4-16,
  ``chain_twice`` sends two stage-2 requests to one parent at once,
  ``chain_expired`` sends stage 2 after the parent's TTL (must be a 404);
  a quarter of the stage-1 prompts are RAG prompts;
- ``rag``: ``chunks: [system, doc, ..., question]`` over the corpus's
  document pool;
- ``rag_paths``: ``rag`` on paths or ``choose``, a quarter of them with
  ``threshold``'s threshold (rejected while their paths are scored);
- ``threshold``: ``cache_hit_threshold: 1.0``, which no request can meet,
  so it must finish with ``finish_reason: "cache_threshold"``;
- ``malformed``: one of :data:`MALFORMED`, which must get a 4xx.

Every request runs under one time limit, so a hang is a recorded timeout,
never a stuck client.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from vllm_kvreuse.testing.server import SERVED_MODEL
from vllm_kvreuse.testing.soak.corpus import Corpus, Prompt
from vllm_kvreuse.testing.soak.records import TIMEOUT, Record

WEIGHTS: dict[str, float] = {
    "plain": 10,
    "stream": 8,
    "abandon": 8,
    "chain": 10,
    "chain_beam": 8,
    "chain_twice": 5,
    "chain_expired": 4,
    "rag": 17,
    "rag_paths": 8,
    "threshold": 6,
    "malformed": 6,
}

STAGE1_TTLS = (3.0, 4.0, 5.0)
"""Short, as the issue's client used; long enough that stage 2 arrives in time."""
EXPIRED_TTL = 1.0
MAX_TTL = max(*STAGE1_TTLS, EXPIRED_TTL)
SUFFIX = " then recommend"

_X = {"model": SERVED_MODEL, "prompt": "hello there", "max_tokens": 2}
_C = {"model": SERVED_MODEL, "max_tokens": 2}
MALFORMED: dict[str, dict[str, Any] | bytes] = {
    "retain_kv_string": {**_X, "retain_kv": "yes"},
    "retain_kv_ttl_string": {**_X, "retain_kv": True, "retain_kv_ttl": "soon"},
    "retain_kv_ttl_negative": {**_X, "retain_kv": True, "retain_kv_ttl": -3},
    "threshold_too_high": {**_X, "cache_hit_threshold": 2},
    "threshold_string": {**_X, "cache_hit_threshold": "high"},
    "continuation_of_int": {"model": SERVED_MODEL, "continuation_of": 5},
    "continuation_with_prompt": {**_X, "continuation_of": "cmpl-nothing"},
    "continuation_both_suffixes": {
        "model": SERVED_MODEL,
        "continuation_of": "cmpl-nothing",
        "continuation_suffix": "a",
        "continuation_suffix_token_ids": [1],
    },
    "empty_segment": {**_C, "chunks": ["sys", "", "q"]},
    "chunks_not_lists": {**_C, "chunks": "x"},
    "chunks_one_segment": {**_C, "chunks": [[1, 2]]},
    "xargs_kvreuse_chunks": {**_X, "vllm_xargs": {"kvreuse_chunks": "x"}},
    "xargs_kvreuse_beam": {**_X, "vllm_xargs": {"kvreuse_beam": "x"}},
    "xargs_kvreuse_parent": {**_X, "vllm_xargs": {"kvreuse_parent": 5}},
    "beam_width_0": {**_X, "use_beam_search": True, "n": 0},
    "beam_width_huge": {**_X, "use_beam_search": True, "n": 100000},
    "use_beam_search_string": {**_X, "use_beam_search": "yes", "n": 2},
    "max_tokens_negative": {**_X, "max_tokens": -1},
    "not_json": b'{"model": "tiny", "prompt": ',
}


class Mix:
    """Sends the mix; every request it makes ends up in ``records``."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        corpus: Corpus,
        *,
        timeout: float,
        weights: dict[str, float] | None = None,
        malformed: dict[str, dict[str, Any] | bytes] | None = None,
    ) -> None:
        self.client = client
        self.corpus = corpus
        self.timeout = timeout
        self.weights = dict(weights or WEIGHTS)
        self.malformed = dict(MALFORMED if malformed is None else malformed)
        self.records: list[Record] = []
        self.outstanding = 0  # requests sent and not answered yet
        self.t0 = time.monotonic()
        self._kinds: dict[str, Callable[[random.Random], Awaitable[None]]] = {
            "plain": self.plain,
            "stream": self.stream,
            "abandon": self.abandon,
            "chain": self.chain,
            "chain_beam": self.chain_beam,
            "chain_twice": self.chain_twice,
            "chain_expired": self.chain_expired,
            "rag": self.rag,
            "rag_paths": self.rag_paths,
            "threshold": self.threshold,
            "malformed": self.bad_body,
        }
        assert set(self.weights) <= set(self._kinds), "unknown kind in weights"

    async def worker(
        self, rng: random.Random, deadline: float, alive: Callable[[], bool]
    ) -> None:
        """Sends kinds drawn from ``rng`` until ``deadline`` (monotonic), or
        until the server is no longer ``alive``."""
        kinds = [k for k, w in self.weights.items() if w > 0]
        weights = [self.weights[k] for k in kinds]
        while time.monotonic() < deadline and alive():
            kind = rng.choices(kinds, weights)[0]
            await self._kinds[kind](rng)

    # -- kinds ------------------------------------------------------------------

    async def plain(self, rng: random.Random) -> None:
        prompt = self.corpus.any_prompt(rng)
        await self.post(f"plain.{_shape(prompt)}", "200", self.body(rng, prompt))

    async def rag(self, rng: random.Random) -> None:
        await self.post("rag", "200", self.body(rng, self.corpus.rag_prompt(rng)))

    async def stream(self, rng: random.Random) -> None:
        prompt = self.corpus.any_prompt(rng)
        await self.stream_post(f"stream.{_shape(prompt)}", self.body(rng, prompt))

    async def abandon(self, rng: random.Random) -> None:
        prompt = self.corpus.any_prompt(rng)
        body = {**self.body(rng, prompt), "max_tokens": 64, "ignore_eos": True}
        after = rng.randint(0, 3)
        await self.stream_post(f"abandon.{_shape(prompt)}", body, abandon_after=after)

    async def rag_paths(self, rng: random.Random) -> None:
        attention = rng.choice(("paths", "choose"))
        body = {
            **self.body(rng, self.corpus.rag_prompt(rng)),
            "chunk_attention": attention,
        }
        if rng.random() < 0.25:
            await self._rejected("rag_paths.threshold", body)
        else:
            await self.post(f"rag_paths.{attention}", "200", body)

    async def threshold(self, rng: random.Random) -> None:
        prompt = self.corpus.any_prompt(rng)
        await self._rejected(f"threshold.{_shape(prompt)}", self.body(rng, prompt))

    async def _rejected(self, kind: str, body: dict[str, Any]) -> None:
        body = {**body, "cache_hit_threshold": 1.0}
        record, _ = await self.post(kind, "200", body)
        if record.ok and record.finish_reason != "cache_threshold":
            record.problem = f"admitted: finish_reason {record.finish_reason!r}"

    async def bad_body(self, rng: random.Random) -> None:
        name = rng.choice(sorted(self.malformed))
        await self.post(f"malformed.{name}", "4xx", self.malformed[name])

    async def chain(self, rng: random.Random) -> None:
        parent = await self.stage1(rng, "chain", rng.choice(STAGE1_TTLS))
        if parent is not None:
            await self.post("chain.stage2", "200", self._child(rng, parent))

    async def chain_beam(self, rng: random.Random) -> None:
        parent = await self.stage1(rng, "chain_beam", rng.choice(STAGE1_TTLS))
        if parent is not None:
            await self.post("chain_beam.stage2", "200", self._beam_child(rng, parent))

    async def chain_twice(self, rng: random.Random) -> None:
        parent = await self.stage1(rng, "chain_twice", rng.choice(STAGE1_TTLS))
        if parent is None:
            return
        first = self._child(rng, parent)
        second = self._beam_child(rng, parent) if rng.random() < 0.5 else first
        await asyncio.gather(
            self.post("chain_twice.stage2", "200", first),
            self.post("chain_twice.stage2", "200", second),
        )

    async def chain_expired(self, rng: random.Random) -> None:
        parent = await self.stage1(rng, "chain_expired", EXPIRED_TTL)
        if parent is None:
            return
        await asyncio.sleep(EXPIRED_TTL + 1.0)
        await self.post("chain_expired.stage2", "404", self._child(rng, parent))

    async def stage1(self, rng: random.Random, kind: str, ttl: float) -> str | None:
        """A retained parent; its response id, or None if it failed."""
        prompt = (
            self.corpus.rag_prompt(rng)
            if rng.random() < 0.25
            else self.corpus.plain_prompt(rng)
        )
        body = {
            **self.body(rng, prompt), "max_tokens": rng.randint(8, 48),
            "ignore_eos": True, "retain_kv": True, "retain_kv_ttl": ttl,
        }  # fmt: skip
        _, payload = await self.post(f"{kind}.stage1", "200", body)
        return payload.get("id") if payload else None

    # -- bodies -----------------------------------------------------------------

    @staticmethod
    def body(rng: random.Random, prompt: Prompt) -> dict[str, Any]:
        return {
            "model": SERVED_MODEL,
            **({"chunks": prompt} if isinstance(prompt, list) else {"prompt": prompt}),
            "max_tokens": rng.randint(4, 48),
            "temperature": rng.choice((0.0, 0.0, 0.8)),
        }  # fmt: skip

    @staticmethod
    def _child(rng: random.Random, parent_id: str) -> dict[str, Any]:
        return {
            "model": SERVED_MODEL, "continuation_of": parent_id,
            "continuation_suffix": SUFFIX, "max_tokens": rng.randint(2, 8),
            "temperature": 0.0,
        }  # fmt: skip

    @staticmethod
    def _beam_child(rng: random.Random, parent_id: str) -> dict[str, Any]:
        return {
            "model": SERVED_MODEL, "continuation_of": parent_id,
            "continuation_suffix": SUFFIX, "use_beam_search": True,
            "n": rng.randint(4, 16), "max_tokens": rng.randint(2, 3),
            "temperature": 0.0,
        }  # fmt: skip

    # -- HTTP -------------------------------------------------------------------

    async def post(
        self, kind: str, expect: str, body: dict[str, Any] | bytes
    ) -> tuple[Record, dict[str, Any] | None]:
        """POSTs ``body`` to /v1/completions; the record and the JSON answer."""
        payload: dict[str, Any] | None = None

        async def send(record: Record) -> None:
            nonlocal payload
            if isinstance(body, bytes):
                headers = {"Content-Type": "application/json"}
                response = await self.client.post(
                    "/v1/completions", content=body, headers=headers
                )
            else:
                response = await self.client.post("/v1/completions", json=body)
            record.status = response.status_code
            try:
                payload = response.json()
            except ValueError:
                record.error = response.text[:300]
                return
            if response.status_code != 200:
                record.error = json.dumps(payload)[:300]
            elif payload.get("choices"):
                record.finish_reason = payload["choices"][0].get("finish_reason")

        record = await self._timed(kind, expect, send)
        return record, payload if record.status == 200 else None

    async def stream_post(
        self, kind: str, body: dict[str, Any], abandon_after: int | None = None
    ) -> Record:
        """Streams a completion; closes it after ``abandon_after`` data chunks."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}

        async def send(record: Record) -> None:
            async with self.client.stream(
                "POST", "/v1/completions", json=body
            ) as response:
                record.status = response.status_code
                if response.status_code != 200:
                    record.error = (await response.aread()).decode()[:300]
                    return
                await self._read_stream(record, response, abandon_after)

        return await self._timed(kind, "200", send)

    @staticmethod
    async def _read_stream(
        record: Record, response: httpx.Response, abandon_after: int | None
    ) -> None:
        num_chunks = 0
        async for line in response.aiter_lines():
            if abandon_after is not None and num_chunks >= abandon_after:
                return  # leaving the context closes the connection: an abort
            if line.strip() == "data: [DONE]":
                return
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[len("data: ") :])
            num_chunks += 1
            if "error" in chunk:
                record.problem = f"error event: {json.dumps(chunk)[:300]}"
                return
            for choice in chunk.get("choices") or ():
                record.finish_reason = choice.get("finish_reason") or (
                    record.finish_reason
                )
        if abandon_after is None:
            record.problem = "stream ended without [DONE]"

    async def _timed(
        self, kind: str, expect: str, send: Callable[[Record], Awaitable[None]]
    ) -> Record:
        """Runs ``send`` under the time limit and records how it ended."""
        start = time.monotonic()
        record = Record(kind=kind, expect=expect, start=start - self.t0)
        self.records.append(record)
        self.outstanding += 1
        try:
            await asyncio.wait_for(send(record), self.timeout)
        except asyncio.TimeoutError:
            record.status, record.error = None, TIMEOUT
        except httpx.HTTPError as e:
            # A dropped connection after the status arrived still counts.
            record.error = f"{type(e).__name__}: {e}"[:300]
            if record.status == 200:
                record.problem = record.error
            await asyncio.sleep(0.5)  # no busy loop against a dead server
        finally:
            self.outstanding -= 1
            record.latency = time.monotonic() - start
        return record


def _shape(prompt: Prompt) -> str:
    return "rag" if isinstance(prompt, list) else "text"
