"""``--chunk-cache-remote-url``: refused at start when unusable (on vLLM's
real parser), and never shown with its password (log lines, the admin
summary)."""

from __future__ import annotations

import logging
import sys

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from vllm_kvreuse.chunk_cache.engine.index import ChunkIndex
from vllm_kvreuse.chunk_cache.engine.tiers import describe
from vllm_kvreuse.chunk_cache.tiers.shared import SharedStore
from vllm_kvreuse.chunk_cache.tiers.urls import parse_store_url, redact_url
from vllm_kvreuse.testing.server import free_port

FLAG = "--chunk-cache-remote-url"


def _parse(argv: list[str]) -> EngineArgs:
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    return AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", "m", *argv]))


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:secret@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        ("redis://user:secret@host", "redis://user:***@host"),
        ("rediss://user:p%40ss:w@host:1", "rediss://user:***@host:1"),
        ("valkey://host:6379?db=1&password=secret", "valkey://host:6379?db=1&password=***"),
        ("unix://:secret@/tmp/valkey.sock", "unix://:***@/tmp/valkey.sock"),
        ("unix:///tmp/valkey.sock?password=s", "unix:///tmp/valkey.sock?password=***"),
        ("valkey://user@host:6379", "valkey://user@host:6379"),
        ("valkey://127.0.0.1:6379", "valkey://127.0.0.1:6379"),
        ("redis://[::1:6379", "***"),
    ],
)  # fmt: skip
def test_redact_url_hides_every_password_and_keeps_the_rest(url, shown) -> None:
    """The userinfo's password and ``password=`` are hidden; a URL with
    neither comes back verbatim; one that does not parse is hidden whole."""
    assert redact_url(url) == shown
    assert redact_url(shown) == shown  # idempotent


@pytest.mark.parametrize(
    "url",
    ["valkey://127.0.0.1:6379", "redis://:secret@host:6380/2", "REDIS://h",
     "valkeys://h", "rediss://u:p@h", "unix:///run/valkey.sock", "redis://[::1]:6379"],
)  # fmt: skip
def test_a_usable_url_is_taken_as_given(url: str) -> None:
    assert parse_store_url(url, FLAG) == url
    assert parse_store_url("", FLAG) == ""


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis://127.0.0.1:notaport", "the port is not a number"),
        ("redis://127.0.0.1:70000", "the port is not a number"),
        ("redis://127.0.0.1:0", "the port is not a number"),
        ("http://127.0.0.1:6379", "an unknown scheme"),
        ("127.0.0.1:6379", "an unknown scheme"),
        ("redis://", "no host"),
        ("redis://:secret@:6379", "no host"),
        ("unix://", "no socket path"),
        ("redis://[::1:6379", "Invalid IPv6 URL"),
    ],
)  # fmt: skip
def test_an_unusable_url_stops_the_server_naming_the_flag(
    url: str, problem: str, capsys
) -> None:
    """A usage error at parse time (nothing connects), naming the flag and
    what is wrong, and not echoing a password."""
    with pytest.raises(SystemExit) as exc:
        _parse([FLAG, url])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert FLAG in err and problem in err
    assert "secret" not in err


def test_a_missing_client_library_stops_the_server_naming_the_package(
    monkeypatch, capsys
) -> None:
    """Without ``valkey`` importable (None in ``sys.modules``: Python's own
    way to make an import fail) the flag is refused with the pip command."""
    monkeypatch.setitem(sys.modules, "valkey", None)
    with pytest.raises(ValueError, match="pip install valkey"):
        parse_store_url("valkey://127.0.0.1:6379", "chunk_cache_remote_url")
    with pytest.raises(SystemExit):
        _parse([FLAG, "valkey://127.0.0.1:6379"])
    assert f"{FLAG} needs the valkey client library" in capsys.readouterr().err
    assert parse_store_url("", FLAG) == ""  # off: valkey is not needed


def test_the_start_up_log_line_hides_the_password() -> None:
    index = ChunkIndex({"device": 1 << 20, "cpu": 0, "disk": 0}, bytes_per_token=64)
    line = describe(index, "", 0, "redis://user:secret@127.0.0.1:6379/0")
    assert "shared store redis://user:***@127.0.0.1:6379/0" in line
    assert "secret" not in line


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_store_that_fails_is_logged_without_its_password() -> None:
    """A real client failing to connect to a closed port: the warning names
    the store, redacted."""
    logger = logging.getLogger("vllm_kvreuse.chunk_cache.tiers.shared")
    handler = _Lines()
    logger.addHandler(handler)
    try:
        url = f"redis://user:secret@127.0.0.1:{free_port()}/0"
        store = SharedStore(url, "fp", rank=0, timeout=0.5)
        assert store.lookup([b"a"]) == {} and not store.available
    finally:
        logger.removeHandler(handler)
    (line,) = handler.lines
    assert "redis://user:***@127.0.0.1" in line and "secret" not in line
