"""The chunk cache's plan types: a chunked request's chunks and spans.

Nothing here holds state; :mod:`.planner` builds these, and turns them into
the messages the workers carry out (:mod:`vllm_kvreuse.chunk_cache.messages`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_kvreuse.chunk_cache.engine.keys import ChunkKey
from vllm_kvreuse.chunk_cache.engine.recompute import Span
from vllm_kvreuse.chunk_cache.messages import Piece


@dataclass(frozen=True, slots=True)
class PlannedChunk:
    """One chunk of a chunked request: where it stands, and where the KV it
    loads was computed (``stored_start``; None: computed here, in place).

    ``saves``: the request computes the chunk in place and stores it (it
    holds the chunk's reservation in the store).
    ``origin``: the origin of the stored chunk it loads, or the one it is
    stored under when it saves (:mod:`.keys`); with ``stored_start`` it
    names the exact bytes a load may use.
    """

    key: ChunkKey
    start: int  # first position in the request
    length: int
    stored_start: int | None = None
    saves: bool = False
    origin: bytes = b""

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def loads(self) -> bool:
        return self.stored_start is not None


@dataclass(slots=True)
class ChunkPlan:
    """A chunked request's chunks, laid end to end from position 0.

    ``spans``: sorted disjoint ranges of chunk positions the request
    computes: every chunk it computes in place, and the tokens of loaded
    chunks it recomputes (:mod:`.recompute`); every other chunk position is
    a *load region*, filled from the store. The request alternates: load a
    region, compute the span after it, load the next, up to the question,
    each computed span a contiguous prefill with exact causality.
    ``pinned``: the plan holds one pin on each chunk it loads, from planning
    until the request's last load is built (or it ends).
    ``unsaved``: the chunks it computes in place and has yet to store.
    ``block_salt``: the ``cache_salt`` its KV blocks are hashed under.
    ``held``: the store entries it pinned, by key (their pins are given back
    to those entries only, :meth:`~.store.ChunkStore.let_go`).
    ``one_pass``: its prefill may run in one step (:mod:`.rows`); once a
    step could not, it runs one span a step.
    """

    chunks: list[PlannedChunk]
    user_salt: str | None = None  # the request's own cache_salt
    block_salt: str | None = None
    pinned: bool = True
    spans: list[Span] = field(default_factory=list)
    unsaved: list[PlannedChunk] = field(default_factory=list)
    held: list[tuple[ChunkKey, Any]] = field(default_factory=list)
    one_pass: bool = True

    @property
    def loaded_keys(self) -> list[ChunkKey]:
        return [chunk.key for chunk in self.chunks if chunk.loads]

    @property
    def end(self) -> int:
        last = self.chunks[-1]
        return last.start + last.length

    def load_regions(self) -> list[Span]:
        """The positions loaded from the store: ``[0, end)`` less the spans."""
        regions, pos = [], 0
        for start, stop in [*self.spans, (self.end, self.end)]:
            if start > pos:
                regions.append((pos, start))
            pos = stop
        return regions

    @property
    def last_load_end(self) -> int:
        """End of the last load region (0 when nothing is loaded)."""
        regions = self.load_regions()
        return regions[-1][1] if regions else 0

    def load_stop(self, pos: int) -> int:
        """End of the load region holding ``pos``; ``pos`` if none does."""
        for start, stop in self.load_regions():
            if start <= pos < stop:
                return stop
        return pos

    def compute_stop(self, pos: int) -> int | None:
        """Where a prefill from ``pos`` must stop: the end of the span
        holding ``pos``, ``pos`` itself inside a load region (load first),
        None past the chunks or in a span that reaches them (no limit)."""
        if pos >= self.end:
            return None
        for start, stop in self.spans:
            if start <= pos < stop:
                # A span that ends the chunks runs on into the question.
                return stop if stop < self.end else None
        return pos

    def pieces(self, start: int, stop: int) -> list[Piece]:
        """The parts of the chunks in ``[start, stop)``, as loads."""
        pieces = []
        for chunk in self.chunks:
            if chunk.stored_start is None:
                continue
            skip = max(0, min(chunk.length, start - chunk.start))
            count = max(0, min(chunk.length, stop - chunk.start)) - skip
            if count > 0:
                pieces.append(
                    Piece(chunk.key, src_start=skip, dst_start=chunk.start + skip,
                          count=count, delta=chunk.start - chunk.stored_start,
                          stored_start=chunk.stored_start, origin=chunk.origin)
                )  # fmt: skip
        return pieces

    def count(self, stats: Any) -> None:
        """Adds the plan's hits and misses to the store's ``stats``."""
        for chunk in self.chunks:
            if chunk.loads:
                stats.hits += 1
                stats.hit_tokens += self.num_loaded(chunk.start, chunk.end)
            else:
                stats.misses += 1
                stats.miss_tokens += chunk.length

    def num_loaded(self, begin: int = 0, limit: int | None = None) -> int:
        """Loaded positions in ``[begin, limit)`` (limit: the chunks' end)."""
        limit = self.end if limit is None else limit
        return sum(
            max(0, min(stop, limit) - max(start, begin))
            for start, stop in self.load_regions()
        )
