"""The chunk cache's plan types: what flows from the scheduler to the workers.

Nothing here holds state; :mod:`.scheduler_side` builds these and
:mod:`.worker_side` carries them out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from vllm_kvreuse.chunk_cache.keys import ChunkKey
from vllm_kvreuse.chunk_cache.store import StoreOp


@dataclass(frozen=True, slots=True)
class PlannedChunk:
    """One chunk of a chunked request: where it stands and where it was computed."""

    key: ChunkKey
    start: int  # first position in the request
    length: int
    virtual_start: int  # position of its first token when it was computed


@dataclass(slots=True)
class ChunkPlan:
    """A chunked request's chunks, laid end to end from position 0.

    ``pinned``: the plan holds one pin on each chunk's store entry, from
    planning until the request's load is built (or it finishes).
    ``recompute``: the chunks' last tokens that are not loaded but prefilled
    with the question, with full attention (``--chunk-recompute-fraction``);
    loads cover ``[0, load_end)`` only.
    """

    chunks: list[PlannedChunk]
    user_salt: str | None = None  # the request's own cache_salt
    pinned: bool = True
    recompute: int = 0

    @property
    def end(self) -> int:
        last = self.chunks[-1]
        return last.start + last.length

    @property
    def load_end(self) -> int:
        """First position vLLM prefills itself (the question's, or earlier)."""
        return self.end - self.recompute


@dataclass(frozen=True, slots=True)
class FillSpec:
    """What a fill computes: ``prompt[start:]`` (the chunk) after
    ``prompt[:start]`` (the system prompt in "system" mode, else nothing)."""

    key: ChunkKey
    prompt: list[int]
    start: int

    @property
    def length(self) -> int:
        return len(self.prompt) - self.start


@dataclass(frozen=True, slots=True)
class Piece:
    key: ChunkKey
    src_start: int  # first token within the stored chunk
    dst_start: int  # its position in the request
    count: int
    delta: int  # actual minus virtual position


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


@dataclass(slots=True)
class ChunkMeta(KVConnectorMetadata):
    """One step's work for the workers, applied in this order: store
    decisions, loads (before the forward pass), saves (after it)."""

    ops: list[StoreOp] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.ops or self.loads or self.saves)
