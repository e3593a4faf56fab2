"""Reference attention masks for checking the chunk cache with Hugging Face.

The chunk cache computes chunk-isolated attention without a mask (each chunk
is prefilled alone); these masks state the same attention explicitly, for
running the model in transformers as a reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def chunk_attention_mask(
    lengths: list[int],
    total: int,
    see_system: bool = False,
    full_from: int | None = None,
) -> torch.Tensor:
    """Additive ``[1, 1, total, total]`` float32 mask for a chunked prompt.

    ``lengths`` are the chunks' token counts, laid end to end from position
    0. A chunk's tokens attend only to earlier tokens of the same chunk (and,
    with ``see_system``, to the first chunk, the system prompt); every token
    past the chunks attends causally to everything before it, and so does
    every token from ``full_from`` on (a recomputed tail of the chunks).
    """
    causal = torch.tril(torch.ones(total, total, dtype=torch.bool))
    allowed = causal.clone()
    start = 0
    for number, length in enumerate(lengths):
        end = start + length
        allowed[start:end, :start] = False
        if see_system and number:
            allowed[start:end, : lengths[0]] = True
        start = end
    if full_from is not None:
        allowed[full_from:] = causal[full_from:]
    mask = torch.zeros(total, total)
    mask[~allowed] = torch.finfo(torch.float32).min
    return mask[None, None]


@torch.no_grad()
def segmented_reference(
    model: Any,
    token_ids: list[int],
    lengths: list[int],
    spans: list[tuple[int, int]],
    steps: int,
    sources: Sequence[Sequence[int] | None],
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and first-step log-probs of a chunked prompt whose
    ``spans`` are computed and whose other chunk positions are loaded,
    built with the model's own KV cache and no mask of ours.

    ``sources[i]`` says what chunk ``i``'s stored KV was computed after, with
    full attention: the tokens that preceded it where it was first computed
    (its stored position is their count); None for a chunk computed here,
    which ``spans`` must cover. A loaded position's KV is its chunk's run
    after its source, shifted to its actual positions (RoPE attention
    depends only on relative positions, so this equals stored KV moved by
    re-rotation); a computed span and the question run with the cache built
    so far, so each of their rows attends causally to everything before it,
    loaded rows as stored. Every step of the chunk cache's segmented
    prefill, in one place.
    """
    end = sum(lengths)
    cache = _segmented_prefill(model, token_ids[:end], lengths, spans, sources)
    return _greedy(model, cache, token_ids[end:], end, steps)


def _segmented_prefill(
    model: Any,
    token_ids: list[int],
    lengths: list[int],
    spans: list[tuple[int, int]],
    sources: Sequence[Sequence[int] | None],
) -> Any:
    """The model's KV cache of the chunks ``token_ids``: each loaded position
    from its chunk run after its source, each of ``spans`` computed on the
    cache built so far."""
    from transformers import DynamicCache

    cache = DynamicCache()
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    end = sum(lengths)
    pos = 0
    for span_start, span_stop in [*spans, (end, end)]:
        for chunk_start, length, source in zip(starts, lengths, sources, strict=True):
            a, b = max(pos, chunk_start), min(span_start, chunk_start + length)
            if a >= b:
                continue
            assert source is not None, (
                f"chunk at {chunk_start} is neither loaded nor computed"
            )
            chunk = token_ids[chunk_start : chunk_start + length]
            first = chunk_start - len(source)  # the source's first position, moved
            stored = model(
                input_ids=torch.tensor([[*source, *chunk]]),
                position_ids=torch.arange(first, chunk_start + length)[None],
                use_cache=True,
            ).past_key_values
            for number, layer in enumerate(stored.layers):
                cut = slice(a - first, b - first)
                cache.update(layer.keys[:, :, cut], layer.values[:, :, cut], number)
        if span_start < span_stop:
            model(
                input_ids=torch.tensor([token_ids[span_start:span_stop]]),
                position_ids=torch.arange(span_start, span_stop)[None],
                past_key_values=cache,
                use_cache=True,
            )
        pos = span_stop
    return cache


def _greedy(
    model: Any, cache: Any, feed: list[int], at: int, steps: int
) -> tuple[list[int], torch.Tensor]:
    """``steps`` greedy tokens after ``feed`` (from position ``at``) on
    ``cache``, and the first step's log-probs."""
    generated: list[int] = []
    first_logprobs = None
    for _ in range(steps):
        logits = model(
            input_ids=torch.tensor([feed]),
            position_ids=torch.arange(at, at + len(feed))[None],
            past_key_values=cache,
            use_cache=True,
        ).logits[0, -1]
        if first_logprobs is None:
            first_logprobs = torch.log_softmax(logits, dim=-1)
        at += len(feed)
        feed = [int(logits.argmax())]
        generated.append(feed[0])
    assert first_logprobs is not None
    return generated, first_logprobs
