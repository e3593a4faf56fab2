"""How a chunked prompt travels from the frontend to the engine.

A client sends its segments in the HTTP body's ``chunks`` field
(:data:`BODY_FIELD`), or a prompt split at ``--chunk-separator``.
``SamplingParams.extra_args["kvreuse_chunks"]`` (an internal key, see
:mod:`vllm_kvreuse.request_args`) holds the token lengths of the prompt's
chunks, in order; the question is the rest of the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_kvreuse.core.request_keys import CHUNKS

BODY_FIELD = "chunks"
"""HTTP body field: a chunked prompt's segments, sent instead of ``prompt``."""
MAX_CHUNKS = 4096


def parse_lengths(lengths: Any) -> list[int]:
    """``lengths`` as a non-empty list of positive token counts."""
    if (
        not isinstance(lengths, Sequence)
        or isinstance(lengths, (str, bytes))
        or not 0 < len(lengths) <= MAX_CHUNKS
        or not all(type(n) is int and n > 0 for n in lengths)
    ):
        raise ValueError(
            f"{CHUNKS} must be a list of 1 to {MAX_CHUNKS} positive token counts"
        )
    return list(lengths)


def validate_lengths(lengths: Any, num_prompt_tokens: int) -> list[int]:
    """``lengths`` as a list of positive ints leaving a non-empty question."""
    lengths = parse_lengths(lengths)
    if sum(lengths) >= num_prompt_tokens:
        raise ValueError("a chunked prompt needs a non-empty question after its chunks")
    return lengths


def chunk_lengths(request: Any, num_prompt_tokens: int) -> list[int] | None:
    """The chunk lengths a request carries (parsed in the frontend: read as
    they are); None for an ordinary request, or for lengths that leave no
    question in its prompt (which then runs unchunked)."""
    params = request.sampling_params
    extra_args = (params.extra_args if params is not None else None) or {}
    lengths = extra_args.get(CHUNKS)
    if lengths is None or sum(lengths) >= num_prompt_tokens:
        return None
    return lengths
