"""How a chunked request is planned: chunk by chunk, front to back.

- a chunk the store holds *as computed after the same tokens* (its origin
  is the one computing it here would give, :mod:`.keys`) is loaded: exactly
  what full attention computes, so nothing of it is recomputed;
- a chunk the store holds as computed elsewhere is loaded and moved there
  by RoPE; its recomputed tokens (:mod:`.recompute`: heads, chunks chosen by
  the question, a tail) are computed in the request;
- a chunk the store does not hold is **computed in place**, attending
  causally to everything before it, and stored from the request's own
  blocks in the step that finishes it, under the origin it was computed
  with (unless another request is computing it now, or the store is full of
  pinned chunks: then it is only computed).

Every chunk a plan loads is pinned as it is placed: no later chunk's
reservation may evict it. An *exact* plan (answer paths' scoring requests,
whose scores must be what computing gives) loads only chunks stored after
the same tokens and computes the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_kvreuse.chunk_cache.engine.keys import Provenance
from vllm_kvreuse.chunk_cache.engine.plan import ChunkPlan, PlannedChunk
from vllm_kvreuse.chunk_cache.engine.recompute import (
    Recompute,
    Span,
    choose_spans,
    clip,
    merge,
)

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from vllm_kvreuse.chunk_cache.engine.index import Entry
    from vllm_kvreuse.chunk_cache.engine.store import ChunkStore


def place_chunks(
    store: ChunkStore,
    request: Request,
    lengths: list[int],
    settings: Recompute,
    exact: bool = False,
) -> ChunkPlan:
    """``request``'s chunks placed (loads pinned, saves reserved); ``exact``:
    only chunks stored after the same tokens are loaded."""
    prompt = request.prompt_token_ids or []
    rules = choose_spans(prompt, lengths, settings)
    provenance = Provenance(request.cache_salt, store.identity)
    lora = getattr(request.lora_request, "lora_name", "")
    chunks: list[PlannedChunk] = []
    spans: list[Span] = []
    held: list[tuple[bytes, Entry]] = []
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    keys = [
        store.key(request.cache_salt, lora, prompt[a : a + n])
        for a, n in zip(starts, lengths, strict=True)
    ]
    store.lookup_shared(keys)
    for key, start, length in zip(keys, starts, lengths, strict=True):
        tokens = prompt[start : start + length]
        chunk, chunk_spans = _place(
            store,
            key,
            (start, length),
            provenance,
            rules,
            held,
            owner_id=request.request_id,
            exact=exact,
        )
        chunks.append(chunk)
        spans += chunk_spans
        provenance.feed(tokens)
    return ChunkPlan(
        chunks,
        user_salt=request.cache_salt,
        block_salt=provenance.block_salt(),
        # Touching spans are one prefill: new chunks side by side are
        # computed together, as plain vLLM computes them (the same kernels
        # and shapes, so the same rounding on any device).
        spans=merge(spans),
        unsaved=[chunk for chunk in chunks if chunk.saves],
        held=held,
    )


def _place(
    store: ChunkStore,
    key: bytes,
    where: tuple[int, int],
    provenance: Provenance,
    rules: list[Span],
    held: list[tuple[bytes, Entry]],
    *,
    owner_id: str,
    exact: bool,
) -> tuple[PlannedChunk, list[Span]]:
    """One chunk's part of the plan (``where``: its start and length), and
    the positions of it computed. A chunk it loads is pinned at once (added
    to ``held``). ``owner_id``: the request that saves it if it is new;
    ``exact``: only a chunk stored after the same tokens is loaded."""
    start, length = where
    whole = (start, start + length)
    origin = provenance.origin(key)
    entry = store.hold(key)
    if entry is None and not store.is_known(key):
        store.note_miss(key)
    if entry is not None and exact and entry.origin != origin:
        store.let_go([(key, entry)])  # stored after other tokens: computed
        return PlannedChunk(key, start, length, origin=origin), [whole]
    if entry is not None:
        held.append((key, entry))
        loaded = PlannedChunk(
            key, start, length, stored_start=entry.start, origin=entry.origin
        )
        if entry.origin == origin:
            store.stats.exact_hits += 1
            return loaded, []
        recomputed = clip(rules, [whole])
        provenance.loaded_approximately(start, length, entry.origin, recomputed)
        return loaded, recomputed
    saves = not store.is_known(key) and store.reserve(
        key, length, start, origin, owner_id
    )
    chunk = PlannedChunk(key, start, length, saves=saves, origin=origin)
    return chunk, [whole]
