"""Blocks held past their request's life, and the requests that inherit them.

A finished request's blocks normally return to the pool (prefix caching may
still find them, best effort). A feature that needs them kept asks the
ledger to *hold* them: continuation keeps a retained parent for its TTL,
beam search keeps a beam until its children have forked it.

Ownership:
- An entry holds exactly one reference on each of its blocks, taken in
  :meth:`BlockLedger.hold` and dropped in :meth:`BlockLedger.release`.
  Nothing else touches those references.
- Entries are kept oldest first; release order under pressure is that order.

Inheritance (read by the core layer, for every feature):
- A request that names a held entry (``extra_args["kvreuse_parent"]``) is
  handed the entry's blocks for their longest common token prefix instead of
  a prefix-cache walk. Upstream's allocator then takes the request's own
  reference on each; where the prefix ends inside a block it gives the
  request a private copy (copy-on-write on the worker), so nobody writes
  into a shared block. The trust is that of prefix caching: only the common
  token prefix, and only with the same ``cache_salt`` and LoRA.
- A request that names no entry but starts with one's tokens (front-end beam
  search) is found by the prefix cache up to the entry's last full block; it
  is then extended into the entry's partial tail block the same way. The
  lookup is one dict access by that block's hash; the hit proves the blocks
  before it are the entry's.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.request import Request

from vllm_kvreuse.core.request_keys import PARENT

if TYPE_CHECKING:
    from vllm_kvreuse.core.upstream.scheduler import Upstream

Hit = tuple[KVCacheBlocks, int, int, bool]
"""What ``Scheduler._get_local_prefix_cache_hit`` returns: blocks, tokens,
shared-prefix boundary, diverged."""


@dataclass(slots=True)
class HeldKV:
    """KV blocks of a finished request, held for later requests.

    ``blocks[g]`` are the request's blocks in KV-cache group ``g`` covering
    ``token_ids`` (its computed tokens: the last sampled token never is).
    """

    request_id: str
    owner: str
    blocks: tuple[list[Any], ...]
    token_ids: list[int]
    cache_salt: str | None
    lora_int_id: int
    expires_at: float
    tail_key: Any = None  # hash of the last full block when a partial one follows

    @property
    def num_blocks(self) -> int:
        return sum(len(group) for group in self.blocks)


def common_prefix_length(a: list[int], b: list[int], limit: int) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, at most ``limit``."""
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:  # the usual case, compared in C
        return n
    return next(i for i in range(n) if a[i] != b[i])


def lora_id(request: Request) -> int:
    return request.lora_request.lora_int_id if request.lora_request else 0


class BlockLedger:
    """Held KV by request id, oldest first; the blocks' extra references."""

    def __init__(self, upstream: Upstream) -> None:
        self._upstream = upstream
        self.block_size = upstream.block_size
        self._entries: OrderedDict[str, HeldKV] = OrderedDict()
        self._by_tail: dict[Any, str] = {}
        # Blocks can be handed over only where they hold the same positions
        # for everyone (full attention, prefix caching on).
        self.enabled = upstream.blocks_are_positional()
        # Set by a release; the layer clears it when a step starts. A release
        # after a step's stats were made needs one more (empty) step to show.
        self.released_since_step = False

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def get(self, request_id: str, now: float | None = None) -> HeldKV | None:
        """The live entry of ``request_id``, or None if absent or expired."""
        entry = self._entries.get(request_id)
        if entry is None:
            return None
        return entry if entry.expires_at > (now or time.monotonic()) else None

    def entries(self, owner: str | None = None) -> Iterator[HeldKV]:
        """Entries oldest first, optionally one owner's."""
        return (e for e in self._entries.values() if owner in (None, e.owner))

    def num_blocks(self, owner: str | None = None) -> int:
        return sum(entry.num_blocks for entry in self.entries(owner))

    def held_blocks(self) -> Iterator[Any]:
        """Every block reference the ledger holds (a block once per entry)."""
        for entry in self._entries.values():
            for group in entry.blocks:
                yield from group

    # -- holding ---------------------------------------------------------------

    def hold(
        self, request: Request, owner: str, expires_at: float = float("inf")
    ) -> HeldKV | None:
        """Takes one reference on the blocks of ``request``'s computed tokens.

        Call while the request still owns its blocks (before upstream frees
        them). None, holding nothing, when blocks cannot be handed over here
        or nothing was computed.
        """
        assert request.request_id not in self._entries, (
            f"{request.request_id} held twice"
        )
        # The last sampled token has no KV yet (and may be in flight with
        # async scheduling); everything before it was computed.
        num_computed = min(request.num_computed_tokens, request.num_tokens - 1)
        if not self.enabled or num_computed <= 0:
            return None
        num_blocks = -(-num_computed // self.block_size)
        groups = self._upstream.blocks_of(request.request_id)
        blocks = tuple(list(group[:num_blocks]) for group in groups)
        for group in blocks:
            self._upstream.reference(group)
        num_full = num_computed // self.block_size
        tail_key = None
        if num_computed % self.block_size and num_full:
            tail_key = request.block_hashes[num_full - 1]
            self._by_tail[tail_key] = request.request_id
        entry = HeldKV(
            request_id=request.request_id,
            owner=owner,
            blocks=blocks,
            token_ids=list(request.all_token_ids[:num_computed]),
            cache_salt=request.cache_salt,
            lora_int_id=lora_id(request),
            expires_at=expires_at,
            tail_key=tail_key,
        )
        self._entries[request.request_id] = entry
        return entry

    def release(self, request_ids: Iterable[str]) -> int:
        """Drops the references of the entries of ``request_ids`` (unknown ids
        are skipped); returns how many entries were released."""
        released = 0
        for request_id in request_ids:
            entry = self._entries.pop(request_id, None)
            if entry is None:
                continue
            if entry.tail_key is not None and self._by_tail.get(entry.tail_key) == (
                request_id
            ):
                del self._by_tail[entry.tail_key]
            for group in entry.blocks:
                # Tail first, as upstream frees: tails are evicted first.
                self._upstream.free(reversed(group))
            released += 1
        self.released_since_step |= released > 0
        return released

    def expired(self, now: float) -> list[str]:
        return [e.request_id for e in self._entries.values() if e.expires_at <= now]

    # -- inheritance -----------------------------------------------------------

    def inherited_hit(self, request: Request) -> Hit | None:
        """The named parent's blocks for ``request``'s common prefix, or None.

        Pure lookup: takes no reference (upstream's allocator does).
        """
        params = request.sampling_params
        extra_args = params.extra_args if params is not None else None
        parent_id = extra_args.get(PARENT) if extra_args else None
        if parent_id is None or not self._upstream.lookup_enabled(request):
            return None
        entry = self.get(parent_id)
        if (
            entry is None
            or entry.cache_salt != request.cache_salt
            or entry.lora_int_id != lora_id(request)
        ):
            return None
        # The request's last prompt token is always computed (its logits).
        num_tokens = common_prefix_length(
            request.all_token_ids, entry.token_ids, limit=request.num_tokens - 1
        )
        if num_tokens == 0:
            return None
        num_blocks = -(-num_tokens // self.block_size)
        blocks = KVCacheBlocks(tuple(group[:num_blocks] for group in entry.blocks))
        return blocks, num_tokens, 0, False

    def extend_into_tail(self, request: Request, hit: Hit) -> Hit | None:
        """Extends a block-aligned prefix-cache hit into a held entry's partial
        tail block; None if there is nothing to extend. Pure lookup."""
        blocks, num_tokens, _, diverged = hit
        if (
            not self._by_tail
            or diverged
            or num_tokens == 0
            or num_tokens % self.block_size
        ):
            return None
        num_full = num_tokens // self.block_size
        entry_id = self._by_tail.get(request.block_hashes[num_full - 1])
        entry = self.get(entry_id) if entry_id else None
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
                [*group, held[num_full]]
                for group, held in zip(blocks.blocks, entry.blocks, strict=True)
            )
        )
        return extended, num_tokens + num_tail, 0, False
