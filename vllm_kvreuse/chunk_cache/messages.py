"""The messages between the chunk cache's two sides.

The engine core's side (:mod:`.engine`) decides, each step, what the
workers do: store decisions (:class:`StoreOp`), loads (:class:`LoadSpec` of
:class:`Piece`) and saves (:class:`SaveSpec`), packed in one
:class:`ChunkMeta`; the workers (:mod:`.worker`) carry them out and report
back what a tier lost (:class:`ChunkWorkerReport`). Both sides import this
module and nothing of each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from vllm_kvreuse.chunk_cache.tiers.codec import ChunkKey, Meta

Tier = Literal["device", "cpu", "disk", "remote"]


@dataclass(frozen=True, slots=True)
class StoreOp:
    """A decision for the workers, applied in order before a step's loads:

    - ``move``: the chunk goes from tier ``source`` to ``target`` (down a
      tier, or up to the device from any; from disk or the shared store
      that is a read);
    - ``evict``: the chunk leaves the local tiers;
    - ``publish``: the chunk is written to the shared store, in the
      background.

    ``meta`` names the chunk the decision is about (its length, the
    position it was computed at, its origin): a worker acts only on bytes
    that are that chunk.
    """

    kind: Literal["move", "evict", "publish"]
    key: ChunkKey
    source: Tier | None = None
    target: Tier | None = None
    meta: Meta | None = None


@dataclass(frozen=True, slots=True)
class Piece:
    """Tokens of one stored chunk to load: the chunk is named by its key,
    the position it was computed at and its origin, and a worker whose bytes
    of ``key`` are another chunk's (a stale plan) fails the load instead."""

    key: ChunkKey
    src_start: int  # first token within the stored chunk
    dst_start: int  # its position in the request
    count: int
    delta: int  # actual minus stored position
    stored_start: int = 0
    origin: bytes = b""


@dataclass(frozen=True, slots=True)
class LoadSpec:
    request_id: str
    block_ids: list[int]
    pieces: list[Piece]


@dataclass(frozen=True, slots=True)
class SaveSpec:
    key: ChunkKey
    block_ids: list[int]
    start: int
    length: int
    origin: bytes = b""


@dataclass(slots=True)
class ChunkMeta(KVConnectorMetadata):
    """One step's work for the workers, applied in this order: store
    decisions, loads (before the forward pass), saves (after it)."""

    ops: list[StoreOp] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.ops or self.loads or self.saves)


@dataclass
class ChunkWorkerReport(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler side after a step: the chunks a
    tier could not give them (their loads failed; the scheduler forgets
    them). vLLM merges every worker's report (:meth:`aggregate`)."""

    lost: set[ChunkKey] = field(default_factory=set)
    dropped: int = 0  # background writes not queued (any rank's most)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> ChunkWorkerReport:
        if isinstance(other, ChunkWorkerReport):
            self.lost |= other.lost
            self.dropped = max(self.dropped, other.dropped)
        return self
