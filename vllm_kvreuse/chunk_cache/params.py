"""How a chunked prompt travels from the frontend to the engine.

``SamplingParams.extra_args["kvreuse_chunks"]`` holds the token lengths of
the prompt's chunks, in order; the question is the rest of the prompt. The
frontend validates it (:func:`validate_lengths`); the engine trusts it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CHUNKS = "kvreuse_chunks"


def validate_lengths(lengths: Any, num_prompt_tokens: int) -> list[int]:
    """``lengths`` as a list of positive ints leaving a non-empty question."""
    if (
        not isinstance(lengths, Sequence)
        or not lengths
        or not all(type(n) is int and n > 0 for n in lengths)
    ):
        raise ValueError(f"{CHUNKS} must be a non-empty list of positive token counts")
    if sum(lengths) >= num_prompt_tokens:
        raise ValueError("a chunked prompt needs a non-empty question after its chunks")
    return list(lengths)


def chunk_lengths(request: Any, num_prompt_tokens: int) -> list[int] | None:
    """The chunk lengths a request carries; None for an ordinary request, or
    for lengths that do not fit its prompt (which then runs unchunked)."""
    params = request.sampling_params
    extra_args = (params.extra_args if params is not None else None) or {}
    if extra_args.get(CHUNKS) is None:
        return None
    try:
        return validate_lengths(extra_args[CHUNKS], num_prompt_tokens)
    except ValueError:
        return None
