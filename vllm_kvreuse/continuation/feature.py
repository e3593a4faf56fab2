"""Continuation requests, engine side: retain a finished parent's KV blocks.

A parent that asked for ``retain_kv`` and finished normally (stop or length)
keeps its blocks: just before upstream frees them, the feature asks the
block ledger to hold the blocks of its computed tokens until its TTL. A
child names the parent (``kvreuse_parent``, set by the frontend) and the
core layer hands it the held blocks (:mod:`vllm_kvreuse.core.ledger`).

Release (always the oldest retained parent first):
- on TTL expiry, checked at every step and by the engine-core utility the
  frontend calls when a TTL runs out (:mod:`.engine`), so an idle engine
  lets go too;
- over budget (``--retain-kv-max-fraction`` of the pool);
- under memory pressure (``release_under_pressure``);
- on ``reset_prefix_cache``.
Released blocks keep their hashes: later children fall back to prefix
caching (best effort).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from vllm.v1.request import Request, RequestStatus

from vllm_kvreuse.continuation import params
from vllm_kvreuse.continuation.records import FinishedRecords
from vllm_kvreuse.core.feature import Feature
from vllm_kvreuse.core.spec import inherited_keys
from vllm_kvreuse.core.upstream.frontend import api_process_count

if TYPE_CHECKING:
    from vllm_kvreuse.core.context import Core

OWNER = "continuation"
_RETAINED_STATUSES = (
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH_CAPPED,
)


class Continuation(Feature):
    """Holds retained parents in the ledger within a TTL and a block budget."""

    name = "continuation"

    def __init__(self, core: Core) -> None:
        super().__init__(core)
        config = core.config
        self.default_ttl = config.retain_kv_ttl
        num_usable_blocks = core.upstream.num_pool_blocks
        self.max_blocks = int(config.retain_kv_max_fraction * (num_usable_blocks - 1))
        # Children may reach another API-server process than their parent:
        # keep what they need here, where every API server can ask for it.
        parallel = core.scheduler.vllm_config.parallel_config
        self.records = (
            FinishedRecords(self.default_ttl, inherited_keys(config.features))
            if api_process_count(parallel) > 1
            else None
        )

    # -- hooks -----------------------------------------------------------------

    def on_add(self, request: Request) -> None:
        if self.records is not None:
            salt = self.core.client_salts.get(request.request_id, request.cache_salt)
            self.records.started(request, salt)

    def on_finish(self, request: Request) -> None:
        if self.records is not None:
            self.records.finished(request)

    def before_free_blocks(self, request: Request) -> None:
        sampling = request.sampling_params
        if (
            sampling is None
            or request.status not in _RETAINED_STATUSES
            or not params.wants_retention(sampling.extra_args)
            or request.request_id in self.core.ledger
        ):
            return
        ttl = params.retention_ttl(sampling.extra_args, self.default_ttl)
        ledger = self.core.ledger
        entry = ledger.hold(request, OWNER, time.monotonic() + ttl)
        if entry is None:
            return
        if entry.num_blocks > self.max_blocks:
            ledger.release([entry.request_id])
            return
        while ledger.num_blocks(OWNER) > self.max_blocks:
            self._release_oldest()

    def before_schedule(self) -> None:
        self.release_expired()

    def release_under_pressure(self) -> bool:
        return self._release_oldest()

    def reset_cache(self) -> None:
        ledger = self.core.ledger
        ledger.release([entry.request_id for entry in ledger.entries(OWNER)])

    def waiting_summary(self) -> dict[str, int]:
        ledger = self.core.ledger
        return {
            "retained": sum(1 for _ in ledger.entries(OWNER)),
            "retained_blocks": ledger.num_blocks(OWNER),
        }

    # -- release ---------------------------------------------------------------

    def release_expired(self) -> int:
        """Releases retained parents past their TTL; returns how many."""
        ledger = self.core.ledger
        now = time.monotonic()
        expired = [
            entry.request_id
            for entry in ledger.entries(OWNER)
            if entry.expires_at <= now
        ]
        return ledger.release(expired)

    def _release_oldest(self) -> bool:
        oldest = next(self.core.ledger.entries(OWNER), None)
        return oldest is not None and self.core.ledger.release([oldest.request_id]) > 0
