"""Reference attention masks for checking the chunk cache with Hugging Face.

The chunk cache computes chunk-isolated attention without a mask (each chunk
is prefilled alone); these masks state the same attention explicitly, for
running the model in transformers as a reference.
"""

from __future__ import annotations

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
