"""Scheduler mixin: retain a finished parent's KV blocks, hand them to its children.

Block ownership:
- A parent that asked for ``retain_kv`` and finished normally (stop or
  length) keeps its blocks: just before upstream frees them, the retention
  store takes one reference on each block covering the parent's computed
  tokens. The store's reference is dropped on TTL expiry, over budget,
  under memory pressure (oldest first), or on ``reset_prefix_cache``; the
  blocks then return to the free queue with their hashes, so the prefix cache
  still serves them (best effort).
- A child names its parent (``extra_args["kvreuse_parent"]``). When the
  scheduler first looks for the child's cached tokens, it is handed the
  parent's blocks for the longest common token prefix instead of a
  prefix-cache walk. Upstream's allocator then takes the child's own
  reference on each (``touch``); when the prefix ends inside a block, the
  allocator gives the child a private copy of that block (copy-on-write,
  done by the worker before the forward pass), so children never write into
  a shared block. The child's prefill is then the tokens past that prefix:
  the suffix plus the parent's last sampled token, which has no KV yet.
- A request that does not name a parent but shares a retained parent's
  prefix (front-end beam search sends one such request per beam per step) is
  found by the prefix cache up to the parent's last full block; it is then
  extended into the parent's partial tail block the same way, copy-on-write,
  so the tail is not recomputed either. The lookup is one dict access keyed
  by the hash of that last full block, whose identity the prefix-cache hit
  itself proves.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.request import Request, RequestStatus

from vllm_kvreuse.config import KVReuseConfig
from vllm_kvreuse.continuation import params
from vllm_kvreuse.continuation.retention import RetainedParent, RetentionStore

logger = init_logger(__name__)

_RETAINED_STATUSES = (
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH_CAPPED,
)


def common_prefix_length(a: list[int], b: list[int], limit: int) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, at most ``limit``."""
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:  # the usual case, compared in C
        return n
    return next(i for i in range(n) if a[i] != b[i])


def lora_id(request: Request) -> int:
    return request.lora_request.lora_int_id if request.lora_request else 0


class ContinuationMixin(Scheduler):
    """Keeps retained parents' blocks and lets children inherit them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = KVReuseConfig.from_vllm_config(self.vllm_config)
        self.retain_kv_ttl = config.retain_kv_ttl
        num_usable_blocks = self.kv_cache_manager.block_pool.num_gpu_blocks - 1
        self.retained = RetentionStore(
            int(config.retain_kv_max_fraction * num_usable_blocks)
        )
        self.supports_inheritance = self._kv_layout_supports_inheritance()
        # Set when blocks were released outside a step, so that one (empty)
        # step runs and publishes the new KV usage in the scheduler stats.
        self._publish_release = False
        # Retained parents with a partial tail block, by the hash of their
        # last full block (see _extend_into_retained_tail).
        self._tails: dict[Any, str] = {}

    def _kv_layout_supports_inheritance(self) -> bool:
        """Full attention in every group, prefix caching on: blocks are positional."""
        groups = self.kv_cache_manager.kv_cache_config.kv_cache_groups
        ok = self.kv_cache_manager.enable_caching and all(
            type(group.kv_cache_spec) is FullAttentionSpec
            and group.kv_cache_spec.block_size == self.block_size
            for group in groups
        )
        if not ok:
            logger.info(
                "vllm-kvreuse: continuation requests fall back to prefix caching "
                "(needs prefix caching on and full-attention KV cache groups)."
            )
        return ok

    # -- upstream hooks -----------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        self._publish_release = False
        self._release(self.retained.pop_expired(time.monotonic()))
        output = super().schedule(*args, **kwargs)
        if self.retained and self._under_memory_pressure(output):
            self._release([self.retained.pop_oldest()])
        return output

    def has_requests(self) -> bool:
        return self._publish_release or super().has_requests()

    def release_expired(self) -> int:
        """Releases retained parents past their TTL; returns how many.

        Called between steps (an engine-core utility the frontend invokes when
        a TTL runs out), so an idle engine does not hold expired blocks.
        """
        expired = self.retained.pop_expired(time.monotonic())
        self._release(expired)
        self._publish_release = self._publish_release or bool(expired)
        return len(expired)

    def _free_blocks(self, request: Request) -> None:
        if self._should_retain(request):
            self._retain(request)
        super()._free_blocks(request)

    def _get_local_prefix_cache_hit(
        self, request: Request
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        inherited = self._inherited_hit(request)
        if inherited is not None:
            return inherited
        hit = super()._get_local_prefix_cache_hit(request)
        return self._extend_into_retained_tail(request, hit) or hit

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        """Releases every retained parent too: its blocks are cache."""
        self._release(self.retained.pop_all())
        return super().reset_prefix_cache(*args, **kwargs)

    # -- retention ------------------------------------------------------------

    def _should_retain(self, request: Request) -> bool:
        params_ = request.sampling_params
        return (
            self.supports_inheritance
            and params_ is not None
            and params.wants_retention(params_.extra_args)
            and request.status in _RETAINED_STATUSES
            and request.request_id not in self.retained
        )

    def _retain(self, request: Request) -> None:
        """Moves ``request``'s computed blocks into the retention store."""
        assert request.sampling_params is not None
        ttl = params.retention_ttl(
            request.sampling_params.extra_args, self.retain_kv_ttl
        )
        entry = self._hold(request, time.monotonic() + ttl)
        if entry is None:
            return
        if not self.retained.fits(entry.num_blocks):
            self._release([entry])
            return
        self._release(self.retained.add(entry))
        num_computed = len(entry.token_ids)
        num_full = num_computed // self.block_size
        if num_computed % self.block_size and num_full:
            self._tails[request.block_hashes[num_full - 1]] = request.request_id

    def _hold(self, request: Request, expires_at: float) -> RetainedParent | None:
        """Takes one reference on the blocks of ``request``'s computed tokens.

        The caller owns the returned entry and must ``_release`` it.
        """
        # The last sampled token has no KV yet (and may be in flight with
        # async scheduling); everything before it was computed.
        num_computed = min(request.num_computed_tokens, request.num_tokens - 1)
        if num_computed <= 0:
            return None
        num_blocks = -(-num_computed // self.block_size)
        groups = self.kv_cache_manager.get_blocks(request.request_id).blocks
        blocks = tuple(list(group[:num_blocks]) for group in groups)
        for group in blocks:
            self.kv_cache_manager.block_pool.touch(group)
        return RetainedParent(
            request_id=request.request_id,
            blocks=blocks,
            token_ids=list(request.all_token_ids[:num_computed]),
            cache_salt=request.cache_salt,
            lora_int_id=lora_id(request),
            expires_at=expires_at,
        )

    def _parent_entry(self, parent_id: str) -> RetainedParent | None:
        """The held KV of ``parent_id``; other mixins may hold parents too."""
        return self.retained.get(parent_id, time.monotonic())

    def _release(self, entries: list[RetainedParent]) -> None:
        """Drops the store's reference on each entry's blocks."""
        if entries and self._tails:
            released = {entry.request_id for entry in entries}
            self._tails = {h: r for h, r in self._tails.items() if r not in released}
        for entry in entries:
            for group in entry.blocks:
                # Tail first, as upstream frees: tails are evicted first.
                self.kv_cache_manager.block_pool.free_blocks(reversed(group))

    def _under_memory_pressure(self, output: SchedulerOutput) -> bool:
        """The step preempted a request, or admitted nothing while requests wait."""
        stalled = not output.num_scheduled_tokens and bool(self.waiting)
        return bool(output.preempted_req_ids) or stalled

    # -- inheritance ----------------------------------------------------------

    def _inherited_hit(
        self, request: Request
    ) -> tuple[KVCacheBlocks, int, int, bool] | None:
        """The parent's blocks for ``request``'s common prefix, or None.

        Pure lookup: takes no reference (upstream's allocator does).
        """
        params_ = request.sampling_params
        parent_id = params.parent_of(params_.extra_args if params_ else None)
        if parent_id is None or not self.kv_cache_manager.prefix_cache_lookup_enabled(
            request
        ):
            return None
        entry = self._parent_entry(parent_id)
        if (
            entry is None
            or entry.cache_salt != request.cache_salt
            or entry.lora_int_id != lora_id(request)
        ):
            return None
        # The child's last prompt token is always computed (its logits).
        num_tokens = common_prefix_length(
            request.all_token_ids, entry.token_ids, limit=request.num_tokens - 1
        )
        if num_tokens == 0:
            return None
        num_blocks = -(-num_tokens // self.block_size)
        blocks = KVCacheBlocks(tuple(group[:num_blocks] for group in entry.blocks))
        return blocks, num_tokens, 0, False

    def _extend_into_retained_tail(
        self, request: Request, hit: tuple[KVCacheBlocks, int, int, bool]
    ) -> tuple[KVCacheBlocks, int, int, bool] | None:
        """Extends a block-aligned prefix-cache hit into a retained parent's tail.

        The hit's last block is the parent's last full block (same hash, and
        checked to be the same physical block), so the tokens before it are the
        parent's; the tail's own tokens are compared. Pure lookup.
        """
        blocks, num_tokens, _, diverged = hit
        if (
            not self._tails
            or not self.supports_inheritance
            or diverged
            or num_tokens == 0
            or num_tokens % self.block_size
        ):
            return None
        num_full = num_tokens // self.block_size
        parent_id = self._tails.get(request.block_hashes[num_full - 1])
        entry = self.retained.get(parent_id, time.monotonic()) if parent_id else None
        if entry is None or entry.blocks[0][num_full - 1] is not blocks.blocks[0][-1]:
            return None
        num_tail = common_prefix_length(
            request.all_token_ids[num_tokens:],
            entry.token_ids[num_tokens:],
            limit=request.num_tokens - 1 - num_tokens,
        )
        if num_tail == 0:
            return None
        extended = KVCacheBlocks(
            tuple(
                [*group, parent_group[num_full]]
                for group, parent_group in zip(blocks.blocks, entry.blocks, strict=True)
            )
        )
        return extended, num_tokens + num_tail, 0, False
