"""Content keys of chunks and the cache salt of chunked requests.

A chunk's key covers everything its KV depends on: its token ids, the model,
the KV dtype, the request's ``cache_salt`` (tenant isolation), the attention
mode, and in "system" mode the system prompt's tokens it attended to. The
hash is vLLM's configured prefix-caching hash (sha256 by default), so keys
are as collision-resistant as vLLM's own block hashes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vllm.utils.hashing import get_hash_fn_by_name

ChunkKey = bytes


def key_hasher(vllm_config: Any, name: str) -> Callable[[Any], bytes]:
    """The hash function ``name``, or vLLM's prefix-caching hash when empty."""
    return get_hash_fn_by_name(
        name or vllm_config.cache_config.prefix_caching_hash_algo
    )


def model_identity(vllm_config: Any, mode: str) -> tuple[str, ...]:
    """What besides tokens a chunk's KV depends on, for every key."""
    model = vllm_config.model_config
    return (
        str(model.model),
        str(model.revision or ""),
        str(vllm_config.cache_config.cache_dtype),
        str(model.dtype),
        mode,
    )


def chunk_key(
    hasher: Callable[[Any], bytes],
    identity: tuple[str, ...],
    salt: str | None,
    context: Sequence[int],
    tokens: Sequence[int],
) -> ChunkKey:
    """The key of ``tokens`` computed after ``context`` (the system prompt in
    "system" mode, else empty)."""
    return hasher((identity, salt or "", tuple(context), tuple(tokens)))


def chunked_salt(salt: str | None, mode: str, lengths: Sequence[int]) -> str:
    """The ``cache_salt`` a chunked request's blocks are hashed under.

    Blocks filled from chunk KV hold values no ordinary request computes, so
    they must never match one; and two chunked requests agree on a block's
    values only if they split their prompts the same way. Both hold when the
    salt carries the mode and the segment lengths.
    """
    shape = ",".join(map(str, lengths))
    return f"kvreuse-chunks/{mode}/{shape}/{salt or ''}"
