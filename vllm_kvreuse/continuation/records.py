"""Engine-side records of finished requests, for children that reach another
API-server process than their parent's.

With ``--api-server-count N`` (``--data-parallel-size N`` defaults to N API
servers too), each API-server process sees only the requests it served, yet
a client's next request may land on any of them. The engine core that ran a
parent saw everything a child needs: the prompt token ids, the output token
ids, the cache_salt and the LoRA adapter. So each engine core keeps a bounded
record of its finished requests, and an API server that does not know a
parent asks every engine core (:mod:`vllm_kvreuse.continuation.remote`); the
one that answers is the DP rank whose ledger holds the parent's blocks. No
service is shared between processes.

Invariants:
- only requests that finished in the engine by stop token, EOS or length are
  recorded: their output token ids are exactly what the client received (the
  frontend trims tokens only after a stop *string*, and then aborts the
  engine request, which is not recorded);
- a record is keyed by the client's request id (the engine request id less
  vLLM's random suffix), so ``cmpl-…-0`` or, for choice ``k`` of an ``n > 1``
  request, ``k_cmpl-…-0``;
- a lookup with another cache_salt gets exactly the answer of an unknown id;
- at most :data:`MAX_RECORDS` records, oldest dropped first, each kept for
  its request's retention TTL (the server default for others).
Kept only when the deployment has more than one API-server process.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from vllm import envs
from vllm.v1.request import Request, RequestStatus

from vllm_kvreuse.continuation import params
from vllm_kvreuse.continuation.registry import MAX_RECORDS
from vllm_kvreuse.core.request_keys import carried

RUNNING = "running"
_RECORDED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
_SUFFIX_LEN = 9  # "-" + 8 random characters (InputProcessor.assign_request_id)


def client_key(engine_request_id: str) -> str:
    """The id the client knows a request by: the engine id less vLLM's
    random suffix (absent with ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``)."""
    if envs.VLLM_DISABLE_REQUEST_ID_RANDOMIZATION:
        return engine_request_id
    return engine_request_id[:-_SUFFIX_LEN]


class ParentAnswer(TypedDict):
    """What an engine core tells another API-server process about a parent
    it ran. A plain dict: it crosses processes as an engine-core utility's
    result. That process keeps it as a
    :class:`~vllm_kvreuse.continuation.registry.ParentRecord`
    (:func:`vllm_kvreuse.continuation.remote.find_remote`)."""

    engine_request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    lora_name: str | None
    inherited: dict[str, Any]
    """The request keys a child carries (:attr:`ArgKey.inherited`)."""


@dataclass(slots=True)
class FinishedRecord:
    answer: ParentAnswer
    """Built once, when the request finishes; never mutated."""
    cache_salt: str | None
    expires_at: float


class FinishedRecords:
    """Running and recently finished client requests of one engine core."""

    def __init__(
        self,
        default_ttl: float,
        inherited_keys: frozenset[str] = frozenset(),
        max_records: int = MAX_RECORDS,
    ) -> None:
        self.default_ttl = default_ttl
        self.inherited_keys = inherited_keys
        self.max_records = max_records
        self._running: dict[str, tuple[str, str | None]] = {}
        self._finished: OrderedDict[str, FinishedRecord] = OrderedDict()

    def started(self, request: Request, cache_salt: str | None) -> None:
        """``cache_salt``: the client's (the chunk cache rehashes a chunked
        request under a salt of its own)."""
        key = client_key(request.request_id)
        self._running[key] = (request.request_id, cache_salt)

    def finished(self, request: Request) -> None:
        key = client_key(request.request_id)
        running = self._running.get(key)
        if running is None or running[0] != request.request_id:
            return  # an internal request, or a later one reusing the id
        del self._running[key]
        sampling = request.sampling_params
        if request.status not in _RECORDED or sampling is None:
            return
        extra = sampling.extra_args or {}
        ttl = params.retention_ttl(extra, self.default_ttl)
        lora = request.lora_request
        self._finished.pop(key, None)
        answer = ParentAnswer(
            engine_request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids or []),
            output_token_ids=list(request.output_token_ids),
            lora_name=lora.lora_name if lora is not None else None,
            inherited=carried(extra, self.inherited_keys),
        )
        self._finished[key] = FinishedRecord(answer, running[1], time.monotonic() + ttl)
        while len(self._finished) > self.max_records:
            self._finished.popitem(last=False)

    def find(
        self, keys: Sequence[str], cache_salt: str | None
    ) -> ParentAnswer | str | None:
        """The first live record's answer among ``keys``, :data:`RUNNING` if
        one is still running here, else None."""
        now = time.monotonic()
        for key in keys:
            record = self._finished.get(key)
            if record is not None and record.expires_at <= now:
                del self._finished[key]
                record = None
            if record is not None and record.cache_salt == cache_salt:
                return record.answer
            running = self._running.get(key)
            if running is not None and running[1] == cache_salt:
                return RUNNING
        return None

    def __len__(self) -> int:
        return len(self._finished)
