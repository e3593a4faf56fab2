"""Stored chunks as bytes: what the disk tier and the shared store hold.

A chunk's KV (``[layers, 2, n, H, D]``, one tensor per worker rank) is
written as one blob: a fixed magic, a JSON header, then the tensor's raw
bytes. The header binds the bytes to everything they mean, so a reader
checks what it got against what it asked for before anything reaches a KV
block, and any difference is a miss (:class:`CorruptChunk`), never a load:

- ``fingerprint``: the store's fingerprint (model, weights, dtype, layout:
  :func:`.identity.store_fingerprint`);
- ``key``: the chunk's content key, and ``rank``: the worker rank whose
  heads or layers the bytes hold;
- ``tokens``, ``start`` and ``origin``: the chunk's :class:`Meta` (the
  position it was computed at fixes its re-rotation, the origin whether it
  loads as exact), so a blob and a meta from two writers never mix;
- ``dtype`` and ``shape`` of the tensor, checked against the reader's
  layout;
- ``crc32`` of header and bytes (accidents), or with a store key
  ``hmac``: HMAC-SHA256 under the key (nobody without it can write a blob
  a reader accepts). A reader with a key accepts only blobs with a valid
  HMAC; one without accepts only checksummed blobs.

Decoding never raises anything but :class:`CorruptChunk`, whatever the
bytes: a hostile or damaged blob costs a recomputation, not a worker.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

ChunkKey = bytes


@dataclass(frozen=True, slots=True)
class Meta:
    """What a stored chunk's readers need beside its bytes: its length, the
    position it was computed at and its origin (:mod:`..engine.keys`)."""

    num_tokens: int
    start: int
    origin: bytes

    def fields(self) -> dict:
        return {
            "tokens": self.num_tokens,
            "start": self.start,
            "origin": self.origin.hex(),
        }

    def to_json(self) -> str:
        return json.dumps(self.fields())

    @classmethod
    def from_fields(cls, data: dict) -> Meta:
        """The meta of a header or meta record; raises :class:`CorruptChunk`."""
        try:
            meta = cls(
                int(data["tokens"]), int(data["start"]), bytes.fromhex(data["origin"])
            )
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise CorruptChunk(f"unreadable chunk meta: {error!r}") from None
        if meta.num_tokens <= 0 or meta.start < 0:
            raise CorruptChunk("chunk meta out of range")
        return meta

    @classmethod
    def from_json(cls, text: str | bytes) -> Meta:
        """The meta of ``text``; raises :class:`CorruptChunk` if unreadable."""
        try:
            data = json.loads(text)
        except (ValueError, TypeError) as error:
            raise CorruptChunk(f"unreadable chunk meta: {error!r}") from None
        if not isinstance(data, dict):
            raise CorruptChunk("unreadable chunk meta")
        return cls.from_fields(data)


@dataclass(frozen=True, slots=True)
class Layout:
    """What a reader's KV looks like: the dtype and one token's
    ``(layers, 2, H, D)``; a blob of any other is not this reader's."""

    dtype: torch.dtype
    token_shape: tuple[int, int, int, int]

    def shape(self, num_tokens: int) -> list[int]:
        layers, two, heads, size = self.token_shape
        return [layers, two, num_tokens, heads, size]


MAGIC = b"KVRC\x02"
"""Blob format 2 (format 1 carried no meta: never read)."""
MAX_HEADER = 1 << 16
DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int8,
        torch.uint8,
    )
}
"""The KV dtypes a blob may name (anything else is not a chunk)."""
SEALS = ("crc32", "hmac")


class CorruptChunk(ValueError):
    """A blob that is not the chunk asked for, or is damaged."""


def fingerprint(parts: Sequence[object]) -> str:
    """A short name for what stored chunk bytes depend on: the model
    identity, the KV dtype, the tensor layout and parallel rank, the block
    size and the key hash (``parts``, in a fixed order)."""
    return hashlib.sha256(repr(tuple(parts)).encode()).hexdigest()[:24]


def encode(
    tensor: torch.Tensor,
    key: bytes,
    store: str,
    meta: Meta,
    rank: int = 0,
    secret: bytes | None = None,
) -> bytes:
    """``tensor`` (any device) as one blob bound to ``key``, ``store``,
    ``meta`` and ``rank``, sealed with ``secret`` if given."""
    data = tensor.detach().contiguous().cpu()
    raw = data.view(torch.uint8).numpy().tobytes()
    body = {
        "fingerprint": store,
        "key": key.hex(),
        "rank": rank,
        **meta.fields(),
        "dtype": str(data.dtype).removeprefix("torch."),
        "shape": list(data.shape),
    }
    header = dict(body, **_seal(body, raw, secret))
    text = json.dumps(header, sort_keys=True).encode()
    return MAGIC + struct.pack("<I", len(text)) + text + raw


def decode(
    blob: bytes,
    key: bytes,
    store: str,
    rank: int = 0,
    expect: Meta | None = None,
    layout: Layout | None = None,
    secret: bytes | None = None,
) -> tuple[torch.Tensor, Meta]:
    """The tensor of ``blob`` (on the CPU) and its meta, checked to be
    ``key``'s for ``rank`` in ``store``, as ``expect`` and ``layout`` say
    (where given), and intact; raises :class:`CorruptChunk` otherwise."""
    try:
        return _decode(blob, key, store, rank, expect, layout, secret)
    except CorruptChunk:
        raise
    except Exception as error:  # hostile bytes must not reach the caller
        raise CorruptChunk(f"unreadable blob: {error!r}") from None


def read_meta(head: bytes) -> Meta:
    """The meta in a blob's first bytes (its header; no check of the bytes
    after it); raises :class:`CorruptChunk`."""
    header, _ = _header(head)
    return Meta.from_fields(header)


def _decode(
    blob: bytes,
    key: bytes,
    store: str,
    rank: int,
    expect: Meta | None,
    layout: Layout | None,
    secret: bytes | None,
) -> tuple[torch.Tensor, Meta]:
    header, start = _header(blob)
    if (
        header.get("fingerprint") != store
        or header.get("key") != key.hex()
        or header.get("rank") != rank
    ):
        raise CorruptChunk("another chunk, rank or store's")
    meta = Meta.from_fields(header)
    if expect is not None and meta != expect:
        raise CorruptChunk("computed elsewhere than the store's record says")
    dtype = DTYPES.get(header.get("dtype"))  # type: ignore[arg-type]
    shape = header.get("shape")
    if dtype is None or not isinstance(shape, list):
        raise CorruptChunk("unknown dtype or shape")
    if not all(isinstance(n, int) and 0 <= n < 1 << 31 for n in shape):
        raise CorruptChunk("shape out of range")
    if layout is not None and (
        dtype != layout.dtype or shape != layout.shape(meta.num_tokens)
    ):
        raise CorruptChunk("another KV layout")
    if len(shape) != 5 or shape[2] != meta.num_tokens:
        raise CorruptChunk("shape and length disagree")
    raw = memoryview(blob)[start:]
    if len(raw) != dtype.itemsize * _numel(shape):
        raise CorruptChunk("damaged: size differs")
    body = {k: v for k, v in header.items() if k not in SEALS}
    sealed = {k: header[k] for k in SEALS if k in header}
    if not hmac.compare_digest(
        json.dumps(sealed, sort_keys=True),
        json.dumps(_seal(body, raw, secret), sort_keys=True),
    ):
        raise CorruptChunk("damaged, or not sealed with this store's key")
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return flat.view(dtype).reshape(shape), meta


def _header(blob: bytes) -> tuple[dict, int]:
    """A blob's header and where its bytes start."""
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 4:
        raise CorruptChunk("not a stored chunk")
    (size,) = struct.unpack_from("<I", blob, len(MAGIC))
    if size > MAX_HEADER or len(blob) < len(MAGIC) + 4 + size:
        raise CorruptChunk("header out of range")
    start = len(MAGIC) + 4 + size
    try:
        header = json.loads(bytes(blob[len(MAGIC) + 4 : start]))
    except (ValueError, TypeError) as error:
        raise CorruptChunk(f"unreadable header: {error!r}") from None
    if not isinstance(header, dict):
        raise CorruptChunk("unreadable header")
    return header, start


def _seal(body: dict, raw: bytes | memoryview, secret: bytes | None) -> dict:
    """The integrity field of a blob: ``hmac`` under ``secret``, else
    ``crc32``, each over the header's other fields and the bytes."""
    text = json.dumps(body, sort_keys=True).encode()
    if secret:
        mac = hmac.new(secret, text, hashlib.sha256)
        mac.update(raw)
        return {"hmac": mac.hexdigest()}
    return {"crc32": zlib.crc32(raw, zlib.crc32(text))}


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count
