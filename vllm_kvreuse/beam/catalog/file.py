"""The ``--sid-catalog`` file: format, parser, and ``load_catalog``.

A UTF-8 text file: a header of ``#`` lines, then one item per line::

    # sid-catalog v1
    # layout: codes
    # codebooks: 8192 8192 8192
    # token-offsets: 151669 159861 168053
    12 4095 7
    12 4095 3001

- Line 1 is exactly ``# sid-catalog v1``.
- Header entries are ``# key: value`` lines with a key named below, each
  at most once; other ``#`` lines are comments; blank lines are skipped.
  The header ends at the first line that does not start with ``#``; past
  it, ``#`` is an error. (Each layout's keys are required, so a misspelt
  key shows up as a missing one.)
- ``layout: codes``: items are SID codes, one per codebook, in codebook
  order. ``codebooks: N1 N2 ...`` gives each codebook's size (its count is
  the item length) and the code -> token id map is either
  ``token-offsets: O1 O2 ...`` (code ``c`` of codebook ``k`` is token
  ``Ok + c``) or ``token-pattern: P1 P2 ...`` (it is the tokenizer token
  named ``Pk`` with ``{}`` replaced by ``c``, e.g. ``<s_a_{}>``).
- ``layout: tokens``: items are vocabulary token ids; all lines have the
  same count, which is the item length (so a fixed marker token such as
  ``<|sid_begin|>`` may lead every item).
- Items: non-negative decimal integers separated by spaces, tabs or commas.
  Duplicate items are accepted and count once (distinct items may share a
  semantic ID, which is all the constraint sees).

Refused, as a ``ValueError`` naming the file and line: everything else,
including a code outside its codebook, a token id outside the vocabulary,
the EOS token inside an item, an empty catalog, more than ``max_items``
item lines (default :data:`MAX_ITEMS`; the message gives the count found),
items longer than :data:`MAX_DEPTH`, and a file over :data:`MAX_FILE_BYTES`.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from vllm_kvreuse.beam.catalog.trie import DENSE_MAX_ENTRIES, SidCatalog

MAGIC = "# sid-catalog v1"
MAX_ITEMS = 1 << 24
"""Default limit on item lines (16,777,216): node ids stay far from int32's."""
MAX_DEPTH = 16
MAX_FILE_BYTES = 4 << 30
_KEYS = ("layout", "codebooks", "token-offsets", "token-pattern")
_ENTRY = re.compile(rf"#\s*({'|'.join(_KEYS)})\s*:(.*)")
_MAX_DIGITS = 12  # ints past 10**12 are no token id; keeps int64 parsing exact
# Commas, tabs and CRs become spaces: one separator to check for below.
_SEPARATORS = bytes.maketrans(b",\t\r", b"   ")


class _Fail:
    """Builds the ``ValueError`` for a bad catalog: file, line, and the line."""

    def __init__(self, source: str, data: bytes) -> None:
        self.source = source
        self.data = data

    def __call__(self, line: int | None, message: str) -> ValueError:
        if line is None:
            return ValueError(f"{self.source}: {message}")
        text = self.data.split(b"\n", line)[line - 1][:80].decode(errors="replace")
        return ValueError(f"{self.source}:{line}: {message} (line: {text.strip()!r})")


@dataclass(frozen=True, slots=True)
class _Header:
    entries: dict[str, tuple[int, str]]  # key -> (its line number, value)
    num_lines: int  # lines before the body
    body_start: int  # byte offset of the body


def load_catalog(
    path: str | os.PathLike[str],
    vocab_size: int,
    *,
    vocab: Mapping[str, int] | None = None,
    eos_token_id: int | None = None,
    max_items: int = MAX_ITEMS,
    dense_max_entries: int = DENSE_MAX_ENTRIES,
    device: torch.device | str | None = None,
) -> SidCatalog:
    """Reads, checks and builds the catalog in ``path`` (see the module doc).

    ``vocab``: the tokenizer's token -> id map, needed by ``token-pattern``.
    ``eos_token_id``: refused inside items (it would end a beam mid-item).
    Raises ``ValueError`` naming ``path`` (and the line) for any bad input.
    """
    source = os.fspath(path)
    try:
        size = os.path.getsize(source)
        if size > MAX_FILE_BYTES:
            raise ValueError(
                f"{source}: SID catalog of {size} bytes is over the limit of "
                f"{MAX_FILE_BYTES} bytes"
            )
        with open(source, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{source}: cannot read the SID catalog: {e}") from None
    items, lines = parse_catalog(
        data, vocab_size, vocab=vocab, max_items=max_items, source=source
    )
    if eos_token_id is not None:
        hits = np.flatnonzero((items == eos_token_id).any(axis=1))
        if len(hits):
            raise _Fail(source, data)(
                int(lines[hits[0]]),
                f"item contains the EOS token {eos_token_id}, which would end "
                "a beam before the item ends",
            )
    return SidCatalog.from_items(
        items, vocab_size, dense_max_entries=dense_max_entries, device=device
    )


def parse_catalog(
    data: bytes,
    vocab_size: int,
    *,
    vocab: Mapping[str, int] | None = None,
    max_items: int = MAX_ITEMS,
    source: str = "<sid-catalog>",
) -> tuple[np.ndarray, np.ndarray]:
    """``(items [N, depth] token ids, line number of each item [N])``.

    Items in file order, duplicates kept. Raises ``ValueError``.
    """
    fail = _Fail(source, data)
    header = _read_header(data, fail)
    entries = header.entries
    if "layout" not in entries:
        raise fail(None, "missing the header line '# layout: codes' (or tokens)")
    layout_line, layout = entries["layout"]
    if layout not in ("codes", "tokens"):
        raise fail(layout_line, f"layout must be codes or tokens, not {layout!r}")
    if layout == "tokens":
        for key in sorted(set(entries) - {"layout"}):
            raise fail(entries[key][0], f"'{key}' does not apply to layout: tokens")
        items, lines = _read_body(data, header, None, max_items, fail)
        bad = np.flatnonzero((items >= vocab_size).any(axis=1))
        if len(bad):
            message = f"token id outside the vocabulary [0, {vocab_size})"
            raise fail(int(lines[bad[0]]), message)
        return items, lines
    sizes = _ints(entries, "codebooks", fail, minimum=1)
    if len(sizes) > MAX_DEPTH:
        message = f"at most {MAX_DEPTH} codebooks, got {len(sizes)}"
        raise fail(entries["codebooks"][0], message)
    tables = _code_tables(entries, sizes, vocab_size, vocab, fail)
    items, lines = _read_body(data, header, len(sizes), max_items, fail)
    for k, (size, table) in enumerate(zip(sizes, tables, strict=True)):
        bad = np.flatnonzero(items[:, k] >= size)
        if len(bad):
            message = f"code {items[bad[0], k]} outside codebook {k} (size {size})"
            raise fail(int(lines[bad[0]]), message)
        items[:, k] = table[items[:, k]]
    return items, lines


def _read_header(data: bytes, fail: _Fail) -> _Header:
    """The leading ``#`` and blank lines; checks the magic line and the keys."""
    entries: dict[str, tuple[int, str]] = {}
    pos = line = 0
    while pos < len(data):
        end = data.find(b"\n", pos)
        end = len(data) if end < 0 else end
        raw = data[pos:end].strip()
        if line and raw and not raw.startswith(b"#"):
            break  # the first item line
        line += 1
        pos = end + 1
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            raise fail(line, "header line is not UTF-8") from None
        if line == 1:
            if text != MAGIC:
                raise fail(1, f"a SID catalog starts with the line {MAGIC!r}")
            continue
        entry = _ENTRY.fullmatch(text)
        if entry is None:
            continue  # a comment or a blank line
        key, value = entry.group(1), entry.group(2).strip()
        if key in entries:
            raise fail(line, f"'{key}' given twice (first on line {entries[key][0]})")
        entries[key] = (line, value)
    if line == 0:
        raise fail(None, "empty file; a SID catalog starts with " + repr(MAGIC))
    return _Header(entries, line, min(pos, len(data)))


def _read_body(
    data: bytes,
    header: _Header,
    depth: int | None,
    max_items: int,
    fail: _Fail,
) -> tuple[np.ndarray, np.ndarray]:
    """Items ``[N, depth]`` and their line numbers ``[N]``, vectorised.

    ``depth`` None: taken from the first item. Checks the characters, the
    count of values on every line and the item limit before converting.
    """
    body = data[header.body_start :].translate(_SEPARATORS)
    first = header.num_lines + 1  # line number of the body's first line
    if not body.strip():
        raise fail(None, "no items")
    chars = np.frombuffer(body, dtype=np.uint8)
    newline = chars == ord("\n")
    gap = newline | (chars == ord(" "))
    digit = (chars >= ord("0")) & (chars <= ord("9"))
    allowed = gap | digit
    if not allowed.all():
        line = first + body.count(b"\n", 0, int(np.argmin(allowed)))
        raise fail(line, "an item is a list of non-negative integers")
    starts = np.flatnonzero(~gap & np.concatenate([[True], gap[:-1]]))
    ends = np.flatnonzero(~gap & np.concatenate([gap[1:], [True]])) + 1
    token_line = np.searchsorted(np.flatnonzero(newline), starts)
    counts = np.bincount(token_line, minlength=int(newline.sum()) + 1)
    item_lines = np.flatnonzero(counts)
    if len(item_lines) == 0:
        raise fail(None, "no items")
    if len(item_lines) > max_items:
        raise fail(
            None,
            f"{len(item_lines)} items, over the limit of {max_items} items per "
            "SID catalog",
        )
    if depth is None:
        depth = int(counts[item_lines[0]])
        if depth > MAX_DEPTH:
            message = f"{depth} tokens per item, over the limit of {MAX_DEPTH}"
            raise fail(first + int(item_lines[0]), message)
    wrong = item_lines[counts[item_lines] != depth]
    if len(wrong):
        message = f"expected {depth} values, got {counts[wrong[0]]}"
        raise fail(first + int(wrong[0]), message)
    too_long = np.flatnonzero(ends - starts > _MAX_DIGITS)
    if len(too_long):
        raise fail(first + int(token_line[too_long[0]]), "value too large")
    # Every token is now a short run of digits, so this parse cannot stop
    # early; a warning would mean it did, and is made an error to be sure.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        values = np.fromstring(body.decode("ascii"), dtype=np.int64, sep=" ")
    assert len(values) == len(starts), "catalog parse lost values"
    return values.reshape(-1, depth), first + item_lines


def _ints(
    entries: dict[str, tuple[int, str]], key: str, fail: _Fail, *, minimum: int
) -> list[int]:
    """The integers of header entry ``key``, each at least ``minimum``."""
    if key not in entries:
        raise fail(entries["layout"][0], f"layout: codes needs '# {key}:'")
    line, value = entries[key]
    fields = value.replace(",", " ").split()
    if not fields or not all(field.isdecimal() for field in fields):
        raise fail(line, f"'{key}' must list integers")
    numbers = [int(field) for field in fields]
    if min(numbers) < minimum:
        raise fail(line, f"'{key}' values must be at least {minimum}")
    return numbers


def _code_tables(
    entries: dict[str, tuple[int, str]],
    sizes: list[int],
    vocab_size: int,
    vocab: Mapping[str, int] | None,
    fail: _Fail,
) -> list[np.ndarray]:
    """Per codebook, the token id of each code: ``[size]`` int64 each."""
    if ("token-offsets" in entries) == ("token-pattern" in entries):
        raise fail(
            entries["layout"][0],
            "layout: codes needs exactly one of '# token-offsets:' and "
            "'# token-pattern:'",
        )
    if "token-offsets" in entries:
        line = entries["token-offsets"][0]
        offsets = _ints(entries, "token-offsets", fail, minimum=0)
        if len(offsets) != len(sizes):
            message = f"{len(offsets)} token offsets for {len(sizes)} codebooks"
            raise fail(line, message)
        for k, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
            if offset + size > vocab_size:
                raise fail(
                    line,
                    f"codebook {k} maps to token ids up to {offset + size - 1}, "
                    f"outside the vocabulary [0, {vocab_size})",
                )
        return [
            np.arange(size) + offset
            for offset, size in zip(offsets, sizes, strict=True)
        ]
    line, value = entries["token-pattern"]
    patterns = value.split()
    if len(patterns) != len(sizes):
        message = f"{len(patterns)} token patterns for {len(sizes)} codebooks"
        raise fail(line, message)
    if any(pattern.count("{}") != 1 for pattern in patterns):
        raise fail(line, "each token pattern holds '{}' once, where the code goes")
    if vocab is None:
        raise fail(line, "'token-pattern' needs the tokenizer's vocabulary")
    tables = []
    for k, (pattern, size) in enumerate(zip(patterns, sizes, strict=True)):
        names = [pattern.replace("{}", str(code)) for code in range(size)]
        ids = np.array([vocab.get(name, -1) for name in names], dtype=np.int64)
        bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
        if len(bad):
            message = (
                f"token {names[bad[0]]!r} (codebook {k}, code {bad[0]}) is not "
                f"in the tokenizer's vocabulary of {vocab_size}"
            )
            raise fail(line, message)
        tables.append(ids)
    return tables
