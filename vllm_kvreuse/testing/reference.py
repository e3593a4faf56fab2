"""Reference attention masks for checking the chunk cache with Hugging Face.

The chunk cache computes chunk-isolated attention without a mask (each chunk
is prefilled alone); these masks state the same attention explicitly, for
running the model in transformers as a reference.
"""

from __future__ import annotations

import torch


def chunk_attention_mask(
    lengths: list[int], total: int, see_system: bool = False
) -> torch.Tensor:
    """Additive ``[1, 1, total, total]`` float32 mask for a chunked prompt.

    ``lengths`` are the chunks' token counts, laid end to end from position
    0. A chunk's tokens attend only to earlier tokens of the same chunk (and,
    with ``see_system``, to the first chunk, the system prompt); every token
    past the chunks attends causally to everything before it.
    """
    allowed = torch.tril(torch.ones(total, total, dtype=torch.bool))
    start = 0
    for number, length in enumerate(lengths):
        end = start + length
        allowed[start:end, :start] = False
        if see_system and number:
            allowed[start:end, : lengths[0]] = True
        start = end
    mask = torch.zeros(total, total)
    mask[~allowed] = torch.finfo(torch.float32).min
    return mask[None, None]
