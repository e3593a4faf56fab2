"""Which finished requests keep their KV blocks, for how long, within what budget.

Pure bookkeeping: the store never touches a block's ref count. The scheduler
mixin takes one reference per block when it adds an entry and drops it for
every entry this store hands back (expired, over budget, released).

Invariants:
- Entries are kept in insertion order, which is also release order under
  budget or memory pressure: the oldest retained parent goes first.
- ``num_blocks`` is the sum of the entries' block counts (blocks shared by
  two entries count twice, so the budget is conservative).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class RetainedParent:
    """KV of a finished request, held for its continuations.

    ``blocks[g]`` are the request's blocks in KV-cache group ``g``, covering
    ``token_ids`` (the tokens whose KV was computed; the last sampled token
    never is). The store's owner holds one reference on each.
    """

    request_id: str
    blocks: tuple[Sequence[Any], ...]
    token_ids: list[int]
    cache_salt: str | None
    lora_int_id: int
    expires_at: float

    @property
    def num_blocks(self) -> int:
        return sum(len(group) for group in self.blocks)


class RetentionStore:
    """Retained parents by engine request id, oldest first."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._entries: OrderedDict[str, RetainedParent] = OrderedDict()
        self.num_blocks = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def get(self, request_id: str, now: float) -> RetainedParent | None:
        """The live entry for ``request_id``, or None if absent or expired."""
        entry = self._entries.get(request_id)
        return entry if entry is not None and entry.expires_at > now else None

    def fits(self, num_blocks: int) -> bool:
        """Whether an entry of ``num_blocks`` could ever be retained."""
        return num_blocks <= self.max_blocks

    def add(self, entry: RetainedParent) -> list[RetainedParent]:
        """Adds ``entry``; returns the oldest entries evicted to stay in budget."""
        assert self.fits(entry.num_blocks), "caller must check fits() first"
        assert entry.request_id not in self._entries, (
            f"request {entry.request_id} retained twice"
        )
        evicted = []
        while self.num_blocks + entry.num_blocks > self.max_blocks:
            evicted.append(self.pop_oldest())
        self._entries[entry.request_id] = entry
        self.num_blocks += entry.num_blocks
        return evicted

    def pop(self, request_id: str) -> RetainedParent | None:
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self.num_blocks -= entry.num_blocks
        return entry

    def pop_oldest(self) -> RetainedParent:
        request_id = next(iter(self._entries))
        entry = self.pop(request_id)
        assert entry is not None
        return entry

    def pop_expired(self, now: float) -> list[RetainedParent]:
        expired = [e.request_id for e in self._entries.values() if e.expires_at <= now]
        return [self.pop(request_id) for request_id in expired]  # type: ignore[misc]

    def pop_all(self) -> list[RetainedParent]:
        return [self.pop(request_id) for request_id in list(self._entries)]  # type: ignore[misc]
