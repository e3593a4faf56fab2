"""Frontend record of recent requests, so that a child can name its parent by id.

Lives in the frontend process (API server or ``LLM`` caller), one registry
per engine client, created with it (``output_processor.kvreuse_parents``,
see :func:`vllm_kvreuse.continuation.frontend.wrap_engine_client_init`).
It learns a request when the output processor adds
it and its tokens when the request's final output is made: the prompt token
ids and the output token ids exactly as delivered (after stop-string
trimming). A child's prompt is built from those lists: no re-tokenisation,
and never tokens the client did not see.

Records are bounded in number (oldest dropped first) and in time (a parent
is forgotten when its retention, or the default TTL, runs out). With several
API-server processes each has its own registry; a child whose parent another
process served is resolved through the engine cores
(:mod:`vllm_kvreuse.continuation.remote`), and the record it gets is kept
here too. With data parallelism each record also knows the DP rank its
request was routed to, so that a child goes to the rank holding the blocks.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.logger import init_logger

logger = init_logger(__name__)

MAX_RECORDS = 4096
"""Records each registry keeps, and each engine core's
:class:`~vllm_kvreuse.continuation.records.FinishedRecords`."""


class ParentNotFound(LookupError):
    """Unknown, expired, aborted, or (to the caller) belonging to another tenant."""


@dataclass(slots=True)
class ParentRecord:
    """One engine request (one choice of a response) as its client saw it."""

    external_id: str
    choice: int
    engine_request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None
    lora_name: str | None
    retain_kv: bool
    ttl: float | None
    """The request's own retain_kv_ttl; None means the server default."""
    is_continuation: bool = False
    inherited: dict[str, Any] = field(default_factory=dict)
    """The parent's request keys a child carries (those the specs mark
    ``inherited``: a chunked parent's chunk lengths, so its children are
    chunked the same way)."""
    output_token_ids: list[int] | None = None
    dp_rank: int | None = None
    """The DP rank (engine index) the request ran on; None without DP."""
    finish_reason: str | None = None
    finished_at: float | None = None
    waiters: list[asyncio.Future[None]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def expired(self, now: float, default_ttl: float) -> bool:
        """Finished longer ago than its TTL (a running parent never expires)."""
        if self.finished_at is None:
            return False
        ttl = default_ttl if self.ttl is None else self.ttl
        return self.finished_at + ttl <= now

    @property
    def token_ids(self) -> list[int]:
        """Prompt then delivered output: the prefix a child continues."""
        assert self.output_token_ids is not None, "parent has not finished"
        return self.prompt_token_ids + self.output_token_ids


class ParentRegistry:
    """Records by (external request id, choice index), oldest first.

    ``release_expired`` wakes the engine core to release expired retentions
    (None offline: the engine releases them at its next step);
    ``inherited_keys``: the request keys a record keeps for its children.
    """

    def __init__(
        self,
        release_expired: Callable[[], Awaitable[Any]] | None,
        default_ttl: float,
        max_records: int = MAX_RECORDS,
        inherited_keys: frozenset[str] = frozenset(),
    ) -> None:
        self.inherited_keys = inherited_keys
        self.max_records = max_records
        self._records: OrderedDict[tuple[str, int], ParentRecord] = OrderedDict()
        self._by_engine_id: dict[str, ParentRecord] = {}
        self.release_expired = release_expired
        self.default_ttl = default_ttl

    def release_when_expired(self, record: ParentRecord) -> None:
        """Asks the engine to release ``record``'s blocks once its TTL is over.

        Only with a bound engine and a running event loop (the API server);
        an offline engine releases expired parents at its next step.
        """
        if self.release_expired is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        ttl = self.default_ttl if record.ttl is None else record.ttl
        loop.call_later(ttl + 0.01, self._release_soon, loop)

    def _release_soon(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self.release_expired is not None
        task = loop.create_task(self.release_expired())
        task.add_done_callback(_log_failure)

    def started(self, record: ParentRecord) -> None:
        key = (record.external_id, record.choice)
        self._forget(self._records.pop(key, None))
        self._records[key] = record
        self._by_engine_id[record.engine_request_id] = record
        while len(self._records) > self.max_records:
            self._forget(self._records.popitem(last=False)[1])

    def _forget(self, record: ParentRecord | None) -> None:
        if record is not None:
            self._by_engine_id.pop(record.engine_request_id, None)

    def routed(self, engine_request_id: str, dp_rank: int) -> None:
        """The DP load balancer sent ``engine_request_id`` to ``dp_rank``."""
        record = self._by_engine_id.get(engine_request_id)
        if record is not None:
            record.dp_rank = dp_rank

    def rank_of(self, engine_request_id: str) -> int | None:
        """The DP rank a recorded request ran on (None if unknown)."""
        record = self._by_engine_id.get(engine_request_id)
        return record.dp_rank if record is not None else None

    def finished(
        self, record: ParentRecord, output_token_ids: list[int], finish_reason: str
    ) -> None:
        """Completes ``record``; an aborted request is forgotten at once."""
        record.output_token_ids = list(output_token_ids)
        record.finish_reason = finish_reason
        record.finished_at = time.monotonic()
        if finish_reason == "abort":
            self._forget(self._records.pop((record.external_id, record.choice), None))
        for waiter in record.waiters:
            waiter.get_loop().call_soon_threadsafe(_resolve, waiter)
        record.waiters.clear()

    def find(
        self, external_id: str, choice: int, cache_salt: str | None, default_ttl: float
    ) -> ParentRecord:
        """The live record, or ``ParentNotFound``.

        A cache_salt mismatch is answered exactly like an unknown id, so ids
        cannot be probed across tenants.
        """
        record = self._records.get((external_id, choice))
        if (
            record is None
            or record.expired(time.monotonic(), default_ttl)
            or record.cache_salt != cache_salt
        ):
            raise ParentNotFound(external_id)
        return record

    def find_response(
        self, response_id: str, choice: int, cache_salt: str | None, default_ttl: float
    ) -> ParentRecord:
        """Looks up by OpenAI response id.

        Completions send prompt ``p`` as engine request ``{id}-{p}``; chat
        sends ``{id}`` itself.
        """
        for external_id in (response_id, f"{response_id}-0"):
            try:
                return self.find(external_id, choice, cache_salt, default_ttl)
            except ParentNotFound:
                continue
        raise ParentNotFound(response_id)

    async def wait(self, record: ParentRecord, timeout: float) -> None:
        """Returns once ``record`` has finished; ``ParentNotFound`` on timeout."""
        if record.finished:
            return
        waiter = asyncio.get_running_loop().create_future()
        record.waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            raise ParentNotFound(record.external_id) from None
        finally:
            if waiter in record.waiters:
                record.waiters.remove(waiter)
        if (record.external_id, record.choice) not in self._records:
            raise ParentNotFound(record.external_id)  # aborted meanwhile


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning(
            "vllm-kvreuse: releasing expired KV failed: %s", task.exception()
        )


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


# Each RequestState's record; weak keys, so records go away with the states
# vLLM owns. Module-level, not on the registry: the final-output hook gets the
# RequestState alone, which has no link to its output processor, and vLLM's
# objects get no attributes of ours outside the patch registry.
_records: weakref.WeakKeyDictionary[Any, tuple[ParentRegistry, ParentRecord]] = (
    weakref.WeakKeyDictionary()
)


def registry_of(output_processor: Any) -> ParentRegistry | None:
    """The registry of an engine client's output processor (None when
    continuation is off)."""
    return getattr(output_processor, "kvreuse_parents", None)


def track(registry: ParentRegistry, request_state: Any, record: ParentRecord) -> None:
    registry.started(record)
    _records[request_state] = (registry, record)


def record_of(request_state: Any) -> tuple[ParentRegistry, ParentRecord] | None:
    return _records.get(request_state)
