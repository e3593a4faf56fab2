"""Server options: one :class:`Option` per setting, and the parsers they use.

A feature declares its options in its spec (:mod:`.spec`); the top floor
(:mod:`vllm_kvreuse.config`) turns them into CLI flags and the config object.
Parsers take the value and the setting's name, return the validated value or
raise ``ValueError`` naming the setting.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def parse_fraction(value: Any, name: str) -> float:
    """Returns ``value`` as a float in [0, 1], or raises ``ValueError``.

    Accepts ints, floats and numeric strings (as the CLI gives them); refuses
    booleans, NaN and anything else, naming ``name`` in the message.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}") from None
    if math.isnan(number) or not 0.0 <= number <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return number


def parse_seconds(value: Any, name: str) -> float:
    """Returns ``value`` as a positive, finite number of seconds."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"{name} must be a positive number of seconds, got {value!r}"
        ) from None
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return number


def parse_tokens(value: Any, name: str) -> int:
    """Returns ``value`` as a token count in [0, 4096] (ints or digit strings)."""
    return _whole(value, name, "a whole number of tokens in [0, 4096]")


def parse_count(value: Any, name: str) -> int:
    """Returns ``value`` as a count in [0, 4096] (ints or digit strings)."""
    return _whole(value, name, "a whole number in [0, 4096]")


def _whole(value: Any, name: str, what: str) -> int:
    """``value`` as an int in [0, 4096] (no booleans; digit strings, as the
    CLI gives them), else ``ValueError`` saying it must be ``what``."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if type(value) is not int or not 0 <= value <= 4096:
        raise ValueError(f"{name} must be {what}")
    return value


def parse_margin(value: Any, name: str) -> float:
    """Returns ``value`` as a finite, non-negative number."""
    return _non_negative(value, name, "a non-negative number")


def _non_negative(value: Any, name: str, what: str) -> float:
    """``value`` as a finite float >= 0 (no booleans), else ``ValueError``
    saying it must be ``what``."""
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return number


def parse_file(value: Any, name: str) -> str:
    """Returns ``value`` as an absolute path to a readable file; ``""`` is off.

    Only checks that the file can be read: its owner parses it where the
    engine starts, naming the setting in any error.
    """
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a file path, got {value!r}")
    if not value:
        return ""
    path = os.path.abspath(os.path.expanduser(value))
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        raise ValueError(f"{name}: {value!r} is not a readable file")
    return path


def parse_bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError(f"{name} must be true or false, got {value!r}")


def parse_gib(value: Any, name: str) -> float:
    """Returns ``value`` as a finite, non-negative number of GiB."""
    return _non_negative(value, name, "a non-negative number of GiB")


def parse_gib_or_auto(value: Any, name: str) -> float | str:
    """A number of GiB, or ``"auto"`` (sized where it is used)."""
    if value == "auto":
        return "auto"
    try:
        return parse_gib(value, name)
    except ValueError:
        raise ValueError(
            f"{name} must be 'auto' or a non-negative number of GiB, got {value!r}"
        ) from None


def parse_directory(value: Any, name: str) -> str:
    """An absolute path to a directory that exists or can be made (made
    here, so a bad path stops the server at once); ``""`` is off."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a directory path, got {value!r}")
    if not value:
        return ""
    path = os.path.abspath(os.path.expanduser(value))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise ValueError(
            f"{name}: cannot use {value!r} as a directory: {error}"
        ) from None
    if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
        raise ValueError(f"{name}: {value!r} is not a writable directory")
    return path


KEY_BYTES = 16


def parse_key_file(value: Any, name: str) -> str:
    """An absolute path to a readable file of at least :data:`KEY_BYTES`
    bytes (a secret; read where it is used, never logged); ``""`` is off."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a file path, got {value!r}")
    if not value:
        return ""
    path = os.path.abspath(os.path.expanduser(value))
    try:
        with open(path, "rb") as file:
            size = len(file.read().strip())
    except OSError as error:
        raise ValueError(f"{name}: cannot read {value!r}: {error}") from None
    if size < KEY_BYTES:
        raise ValueError(f"{name}: the key in {value!r} is under {KEY_BYTES} bytes")
    return path


def parse_separator(value: Any, name: str) -> str:
    """A non-blank separator, or ``""`` (off)."""
    if not isinstance(value, str) or (value and value.isspace()):
        raise ValueError(f"{name} must be a non-blank string or empty, got {value!r}")
    return value


def choice_parser(*choices: str) -> Callable[[Any, str], str]:
    def parse(value: Any, name: str) -> str:
        if value not in choices:
            raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
        return value

    return parse


@dataclass(frozen=True, slots=True)
class Option:
    """One setting: its name in additional_config, CLI flag, parser and help."""

    name: str
    parse: Callable[[Any, str], Any]
    default: Any
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def cli_type(self, text: str) -> Any:
        """argparse ``type=``: turns a parse error into a usage error."""
        try:
            return self.parse(text, self.flag)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
