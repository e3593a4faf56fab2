"""Continuation across processes: API servers, DP ranks.

- A child whose parent this API-server process does not know asks every
  engine core for it (:data:`~vllm_kvreuse.continuation.engine.FIND_PARENT`,
  answered from :mod:`vllm_kvreuse.continuation.records`). The engine that
  knows it is the DP rank whose ledger holds the parent's blocks; the record
  it returns is kept in this process's registry, with that rank.
- Every request that names a parent (``kvreuse_parent``) is routed to the
  parent's DP rank (:func:`wrap_get_core_engine_for_request`), and every
  request's rank is recorded, so that its own children follow it.

What crosses processes is what vLLM already carries: the client's response
id (the look-up key, unguessable as before) and the cache_salt, compared by
the engine exactly as the local registry compares it, so an id is no more
use to another tenant than it is on one process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from vllm_kvreuse.continuation.engine import FIND_PARENT
from vllm_kvreuse.continuation.records import RUNNING, ParentAnswer
from vllm_kvreuse.continuation.registry import (
    ParentNotFound,
    ParentRecord,
    ParentRegistry,
)
from vllm_kvreuse.core.request_keys import PARENT
from vllm_kvreuse.core.upstream.frontend import api_process_count

MAX_ID_LENGTH = 512
"""Longer ``continuation_of`` values are not sent to the engines."""

POLL_SECONDS = (0.005, 0.02, 0.05, 0.1)
"""Waits between asks while the parent is still running elsewhere."""


def is_multi_process(vllm_config: Any) -> bool:
    """Whether children may land on another API-server process than their
    parent's (``--api-server-count``, or DP's default of one per rank)."""
    return api_process_count(vllm_config.parallel_config) > 1


def client_keys(response_id: str, choice: int) -> list[str]:
    """The ids the parent's engine records may have (see
    :func:`vllm_kvreuse.continuation.records.client_key`): chat sends the
    response id itself, completions ``{id}-0``; choice ``k`` of an ``n > 1``
    request is ``k_{id}``."""
    plain = [response_id, f"{response_id}-0"]
    fanned = [f"{choice}_{key}" for key in plain]
    return plain + fanned if choice == 0 else fanned


async def find_remote(
    engine: Any,
    registry: ParentRegistry,
    response_id: str,
    choice: int,
    cache_salt: str | None,
    timeout: float,
) -> ParentRecord:
    """The parent's record from the engine core that ran it, waiting up to
    ``timeout`` while it runs; ``ParentNotFound`` otherwise."""
    if len(response_id) > MAX_ID_LENGTH:
        raise ParentNotFound(response_id[:64])  # no id of ours is that long
    engine_core = engine.engine_core
    keys = client_keys(response_id, choice)
    deadline = time.monotonic() + timeout
    attempt = 0
    while True:
        answers = await engine_core.call_utility_all_async(
            FIND_PARENT, keys, cache_salt
        )
        for rank, answer in enumerate(answers):
            if isinstance(answer, dict):
                return _adopt(registry, response_id, choice, cache_salt, rank, answer)
        if RUNNING not in answers or time.monotonic() >= deadline:
            raise ParentNotFound(response_id)
        pause = POLL_SECONDS[min(attempt, len(POLL_SECONDS) - 1)]
        await asyncio.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
        attempt += 1


def _adopt(
    registry: ParentRegistry,
    response_id: str,
    choice: int,
    cache_salt: str | None,
    rank: int,
    answer: ParentAnswer,
) -> ParentRecord:
    """Keeps a record another process's parent left in engine ``rank``."""
    record = ParentRecord(
        external_id=response_id,
        choice=choice,
        engine_request_id=answer["engine_request_id"],
        prompt_token_ids=list(answer["prompt_token_ids"]),
        cache_salt=cache_salt,
        lora_name=answer["lora_name"],
        retain_kv=False,  # its own process wakes the engine at expiry
        ttl=None,
        inherited=dict(answer["inherited"]),
        dp_rank=rank,
    )
    registry.started(record)
    registry.finished(record, answer["output_token_ids"], "stop")
    return record


def wrap_get_core_engine_for_request(
    original: Callable[..., Any],
) -> Callable[..., Any]:
    """``DPLBAsyncMPClient.get_core_engine_for_request``: a request naming a
    parent goes to the parent's rank; every request's rank is recorded."""

    def get_core_engine_for_request(self: Any, request: Any) -> Any:
        registry: ParentRegistry | None = getattr(self, "kvreuse_parents", None)
        if registry is None:
            return original(self, request)
        sampling = request.sampling_params
        parent = (sampling.extra_args or {}).get(PARENT) if sampling else None
        if parent is not None:
            rank = registry.rank_of(parent)
            if rank is not None:
                # The parent's blocks are there; a header's rank cannot use them.
                request.data_parallel_rank = rank
        engine = original(self, request)
        registry.routed(request.request_id, self.core_engines.index(engine))
        return engine

    return get_core_engine_for_request
