"""Stored chunks as bytes: what the disk tier and the shared store hold.

A chunk's KV (``[layers, 2, n, H, D]``, one tensor per worker rank) is
written as one blob: a fixed magic, a JSON header, then the tensor's raw
bytes. The header names everything the bytes depend on, so a blob written
by another model, dtype, layout or plugin version is recognised and
ignored, never loaded:

- ``fingerprint``: the store's fingerprint (:func:`fingerprint`);
- ``key``: the chunk's content key, hex;
- ``dtype`` and ``shape`` of the tensor;
- ``crc32`` of the raw bytes: a torn or corrupted blob fails its check.

Reading returns the tensor bit for bit as written, or raises
:class:`CorruptChunk`.
"""

from __future__ import annotations

import hashlib
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

    def to_json(self) -> str:
        return json.dumps(
            {
                "tokens": self.num_tokens,
                "start": self.start,
                "origin": self.origin.hex(),
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Meta:
        """The meta of ``text``; raises :class:`CorruptChunk` if unreadable."""
        try:
            data = json.loads(text)
            return cls(
                int(data["tokens"]), int(data["start"]), bytes.fromhex(data["origin"])
            )
        except (ValueError, KeyError, TypeError) as error:
            raise CorruptChunk(f"unreadable chunk meta: {error}") from None


MAGIC = b"KVRC\x01"
"""Blob format 1."""


class CorruptChunk(ValueError):
    """A blob that is not the chunk asked for, or is damaged."""


def fingerprint(parts: Sequence[object]) -> str:
    """A short name for what stored chunk bytes depend on: the model
    identity, the KV dtype, the tensor layout and parallel rank, the block
    size and the key hash (``parts``, in a fixed order)."""
    return hashlib.sha256(repr(tuple(parts)).encode()).hexdigest()[:24]


def encode(tensor: torch.Tensor, key: bytes, store: str) -> bytes:
    """``tensor`` (any device) as one blob naming ``key`` and ``store``."""
    data = tensor.detach().contiguous().cpu()
    raw = data.view(torch.uint8).numpy().tobytes()
    header = json.dumps(
        {
            "fingerprint": store,
            "key": key.hex(),
            "dtype": str(data.dtype).removeprefix("torch."),
            "shape": list(data.shape),
            "crc32": zlib.crc32(raw),
        }
    ).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + raw


def decode(blob: bytes, key: bytes, store: str) -> torch.Tensor:
    """The tensor of ``blob`` (on the CPU), checked to be ``key``'s in
    ``store`` and intact; raises :class:`CorruptChunk` otherwise."""
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 4:
        raise CorruptChunk("not a stored chunk")
    (size,) = struct.unpack_from("<I", blob, len(MAGIC))
    start = len(MAGIC) + 4 + size
    try:
        header = json.loads(blob[len(MAGIC) + 4 : start])
        dtype = getattr(torch, header["dtype"])
        shape = [int(n) for n in header["shape"]]
    except (ValueError, KeyError, AttributeError, TypeError) as error:
        raise CorruptChunk(f"unreadable header: {error}") from None
    if header.get("fingerprint") != store or header.get("key") != key.hex():
        raise CorruptChunk("another chunk, or another store's")
    raw = memoryview(blob)[start:]
    expected = dtype.itemsize * _numel(shape)
    if len(raw) != expected or zlib.crc32(raw) != header.get("crc32"):
        raise CorruptChunk("damaged: size or checksum differs")
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count
