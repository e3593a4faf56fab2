"""Content keys of chunks, the origins of stored chunk KV, and block salts.

Three hashes, each with one job (what stored bytes on disk or in the shared
store belong to, the fingerprint, is :mod:`..tiers.identity`'s):

- A chunk's **content key** names what a request looks up: its token ids,
  the model, the KV dtype and the request's ``cache_salt`` (tenant
  isolation), hashed with vLLM's configured prefix-caching hash (sha256 by
  default), so keys are as collision-resistant as vLLM's own block hashes.
  Whatever preceded the chunk is *not* in it: a chunk is reused anywhere.
- A stored chunk's **origin** names its values. A chunk is stored as it was
  computed in place, inside the request that first brought it, attending to
  everything before it; so its KV depends on what stood before it there.
  The origin is a digest of the content key, the tokens before the chunk
  (which fix its position too) and the *provenance* of their KV: the
  request's ``cache_salt`` while every earlier position holds what full
  attention computes, else a digest of the approximate loads that changed
  them (:class:`Provenance`). Two chunks with one origin hold the same
  values, on any server.
- A chunked request's **block salt** names the values in its KV blocks, for
  vLLM's prefix cache (and every connector keyed by block hashes). A request
  that loaded nothing approximate holds exactly what plain vLLM computes and
  keeps its own ``cache_salt``: its blocks are shared with ordinary requests
  both ways. One that loaded a chunk computed elsewhere is salted with its
  provenance, so its blocks match only a request holding the same values.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from typing import Any

from vllm.utils.hashing import get_hash_fn_by_name

from vllm_kvreuse.chunk_cache.tiers.codec import ChunkKey  # one definition

Origin = bytes

SALT_PREFIX = "kvreuse-chunks/"
"""Block salts of requests holding approximate KV start with this."""


def key_hasher(vllm_config: Any, name: str) -> Callable[[Any], bytes]:
    """The hash function ``name``, or vLLM's prefix-caching hash when empty."""
    return get_hash_fn_by_name(
        name or vllm_config.cache_config.prefix_caching_hash_algo
    )


def chunk_key(
    hasher: Callable[[Any], bytes],
    identity: tuple[str, ...],
    salt: str | None,
    tokens: Sequence[int],
) -> ChunkKey:
    """The content key of ``tokens`` for requests salted ``salt``."""
    return hasher((identity, salt or "", tuple(tokens)))


class Provenance:
    """Walks a chunked prompt front to back, tracking what its KV holds.

    Starts *exact* (every position so far holds full attention's KV, keyed
    by the request's ``cache_salt``); :meth:`loaded_approximately` makes it
    inexact from there on. :meth:`origin` is the origin a chunk computed at
    the current point gets, and the origin a stored chunk must have for
    loading it to give exactly the values computing it here would.

    Invariant: two requests with the same tokens up to a point and the same
    provenance digest there hold the same KV values up to that point.
    """

    def __init__(self, user_salt: str | None, identity: tuple[str, ...]) -> None:
        self._tokens = hashlib.sha256(repr(identity).encode())
        self.user_salt = user_salt or ""
        self._salt = self.user_salt.encode()
        self.exact = True

    def origin(self, key: ChunkKey) -> Origin:
        """The origin of chunk ``key`` computed here, after every token fed."""
        return hashlib.sha256(
            b"".join((key, self._salt, b"|", self._tokens.digest()))
        ).digest()

    def feed(self, tokens: Sequence[int]) -> None:
        """``tokens`` now precede the current point."""
        self._tokens.update(array("q", tokens).tobytes())

    def loaded_approximately(
        self, start: int, length: int, origin: Origin, spans: Sequence[tuple[int, int]]
    ) -> None:
        """Positions ``[start, start + length)`` hold a chunk of ``origin``
        loaded elsewhere than it was computed, ``spans`` of them recomputed."""
        described = f"{start}+{length}:{origin.hex()}:{list(spans)}".encode()
        self._salt = hashlib.sha256(b"|".join((self._salt, described))).digest()
        self.exact = False

    def block_salt(self) -> str | None:
        """The request's block salt: its own ``cache_salt`` while exact."""
        if self.exact:
            return self.user_salt or None
        return f"{SALT_PREFIX}{self._salt.hex()}/{self.user_salt}"
