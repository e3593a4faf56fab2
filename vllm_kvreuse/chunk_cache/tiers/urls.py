"""The shared store's URL: checked when the server starts, redacted wherever
it is shown.

``--chunk-cache-remote-url`` may carry a password
(``redis://user:secret@host:6379/0``, or ``?password=secret``, both of
which the ``valkey`` client reads). The server keeps the URL whole only to
connect (:mod:`.shared`); every log line and endpoint shows
:func:`redact_url` of it.
"""

from __future__ import annotations

import importlib
from typing import Any
from urllib.parse import SplitResult, unquote, urlsplit

SCHEMES = ("valkey", "valkeys", "redis", "rediss", "unix")
"""The schemes the ``valkey`` client's ``from_url`` connects with."""
HIDDEN = "***"
"""What a password is shown as."""


def parse_store_url(value: Any, name: str) -> str:
    """``value`` as a shared-store URL, ``""`` (off), or ``ValueError`` naming
    ``name``: a scheme of :data:`SCHEMES`, a host (``unix``: a socket path),
    a port in [1, 65535] if any, and the ``valkey`` client importable.

    Nothing connects here: a store that is down at start is a store that is
    down (:mod:`.shared` computes what it would have loaded). Messages show
    the URL redacted, since they reach the terminal and the logs.
    """
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a URL, got {type(value).__name__}")
    if not value:
        return ""
    problem = _url_problem(value)
    if problem is not None:
        raise ValueError(
            f"{name} must be a URL like valkey://127.0.0.1:6379 (schemes "
            f"{', '.join(SCHEMES)}): {problem}, got {redact_url(value)!r}"
        )
    try:
        importlib.import_module("valkey")
    except ImportError:
        raise ValueError(
            f"{name} needs the valkey client library, which is not installed: "
            "pip install valkey"
        ) from None
    return value


def _url_problem(url: str) -> str | None:
    """What makes ``url`` unusable as a store URL; None when nothing does."""
    try:
        parts = urlsplit(url)
    except ValueError as error:  # e.g. an unbalanced IPv6 bracket
        return str(error)
    if parts.scheme not in SCHEMES:  # urlsplit lowercases it, as valkey reads it
        return "an unknown scheme"
    if parts.scheme == "unix":
        return None if parts.path else "no socket path"
    try:
        port = parts.port  # parsed lazily: a bad one raises only here
    except ValueError:
        port = 0
    if port == 0:  # urllib allows 0, no server listens there
        return "the port is not a number in [1, 65535]"
    return None if parts.hostname else "no host"


def redact_url(url: str) -> str:
    """``url`` with every password in it shown as :data:`HIDDEN`: the
    userinfo's (``user:secret@``) and a ``password=`` query parameter's.
    Idempotent; the rest is kept verbatim. A URL that does not parse is
    hidden whole (it may hold a password in a place not understood)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return HIDDEN
    redacted = SplitResult(
        parts.scheme,
        _redact_userinfo(parts.netloc),
        parts.path,
        _redact_query(parts.query),
        parts.fragment,
    )
    return url if redacted == parts else _unsplit(redacted)


def _redact_userinfo(netloc: str) -> str:
    """``netloc`` with the password of ``user:password@host`` hidden (split
    at the last ``@``, as :func:`urllib.parse.urlsplit` does)."""
    userinfo, at, host = netloc.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    return f"{user}:{HIDDEN}@{host}" if at and colon else netloc


def _redact_query(query: str) -> str:
    """``query`` with each ``password=...`` value hidden (the others kept
    verbatim, not re-encoded)."""
    pairs = query.split("&") if query else []
    hidden = [
        f"{pair.partition('=')[0]}={HIDDEN}"
        if unquote(pair.partition("=")[0]) == "password"
        else pair
        for pair in pairs
    ]
    return "&".join(hidden)


def _unsplit(parts: SplitResult) -> str:
    """``parts`` as a URL, keeping an empty netloc's ``//`` (``unix:///p``,
    which :func:`urllib.parse.urlunsplit` would shorten to ``unix:/p``)."""
    url = f"{parts.scheme}://{parts.netloc}{parts.path}"
    if parts.query:
        url += f"?{parts.query}"
    return url + (f"#{parts.fragment}" if parts.fragment else "")


def wrap_redact_sensitive_args(original: Any) -> Any:
    """vLLM's redaction of the ``non-default args`` start-up log line, which
    hides only vLLM's own secrets: the store URL's password too."""

    def redact_sensitive_args(args: dict[str, Any]) -> dict[str, Any]:
        redacted = original(args)
        url = redacted.get("chunk_cache_remote_url")
        if isinstance(url, str) and url:
            redacted = {**redacted, "chunk_cache_remote_url": redact_url(url)}
        return redacted

    return redact_sensitive_args
