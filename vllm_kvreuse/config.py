"""vllm-kvreuse settings: one table of options, one frozen config object.

Settings travel to every process inside vLLM's own config, as
``VllmConfig.additional_config["kvreuse"]``: the API server folds the
``vllm serve`` flags (or ``LLM(...)`` keyword arguments) into it, and the
engine core and workers read it back with :meth:`KVReuseConfig.from_vllm_config`.
No environment variable is involved.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

ADDITIONAL_CONFIG_KEY = "kvreuse"


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
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if type(value) is not int or not 0 <= value <= 4096:
        raise ValueError(f"{name} must be a whole number of tokens in [0, 4096]")
    return value


def parse_bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError(f"{name} must be true or false, got {value!r}")


def parse_gib(value: Any, name: str) -> float:
    """Returns ``value`` as a finite, non-negative number of GiB."""
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{name} must be a non-negative number of GiB, got {value!r}")
    return number


def parse_separator(value: Any, name: str) -> str:
    """A non-blank separator, or ``""`` (off)."""
    if not isinstance(value, str) or (value and value.isspace()):
        raise ValueError(f"{name} must be a non-blank string or empty, got {value!r}")
    return value


def parse_catalog_path(value: Any, name: str) -> str:
    """Returns ``value`` as an absolute path to a readable file; ``""`` is off.

    Only checks the file can be read: it is parsed where the engine starts
    (:func:`vllm_kvreuse.beam.catalog_file.load_catalog`).
    """
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a file path, got {value!r}")
    if not value:
        return ""
    path = os.path.abspath(os.path.expanduser(value))
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        raise ValueError(f"{name}: {value!r} is not a readable file")
    return path


def choice_parser(*choices: str) -> Callable[[Any, str], str]:
    def parse(value: Any, name: str) -> str:
        if value not in choices:
            raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
        return value

    return parse


CHUNK_HASHES = ("", "sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
CHUNK_ATTENTION_MODES = ("isolated", "system")


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


OPTIONS: tuple[Option, ...] = (
    Option(
        "global_cache_hit_threshold",
        parse_fraction,
        None,
        "Turns the cache-hit threshold on: reject a request whose KV-cache hit "
        "rate (cached prompt tokens, local prefix cache plus KV connector, "
        "divided by prompt tokens) is below this value with finish_reason "
        "'cache_threshold', before any KV block is allocated. A request's own "
        "'cache_hit_threshold' overrides it; 0 admits every request that sets "
        "none. Unset (the default): the threshold is off and requests that set "
        "'cache_hit_threshold' are refused (400).",
    ),
    Option(
        "enable_continuation",
        parse_bool,
        False,
        "Turns continuation requests on: a request with 'retain_kv' keeps its "
        "KV blocks after it finishes, and a request with 'continuation_of' "
        "inherits them (see --retain-kv-ttl, --retain-kv-max-fraction).",
    ),
    Option(
        "retain_kv_ttl",
        parse_seconds,
        60.0,
        "Seconds a finished request that asked for 'retain_kv' keeps its KV "
        "blocks for continuation requests, unless it set its own "
        "'retain_kv_ttl'.",
    ),
    Option(
        "retain_kv_max_fraction",
        parse_fraction,
        0.25,
        "Largest share of the KV block pool that retained requests may hold. "
        "Past it, or when the scheduler runs short of blocks, the oldest "
        "retained request is released first (its continuations then fall back "
        "to prefix caching).",
    ),
    Option(
        "engine_beam_search",
        parse_bool,
        False,
        "Run use_beam_search requests inside the engine: one engine request "
        "per beam per step, each forking its parent beam's KV blocks "
        "(copy-on-write tail) instead of re-prefilling, with no front-end "
        "round trip between steps.",
    ),
    Option(
        "continuation_wait_timeout",
        parse_seconds,
        60.0,
        "Seconds a continuation request waits for a parent that is still "
        "running before it is answered 404.",
    ),
)
OPTIONS += (
    Option(
        "enable_chunk_cache",
        parse_bool,
        False,
        "Position-independent chunk cache for RAG requests that send their "
        "segments as a 'chunks' field (texts or token-id lists: system prompt, "
        "documents, question): each chunk's KV is computed alone at positions "
        "from 0, cached by content, and reused at any position by re-rotating "
        "its keys. Ordinary prompts are never chunked. Uses the KV-connector "
        "slot.",
    ),
    Option(
        "chunk_separator",
        parse_separator,
        "",
        "Also split text prompts at this separator into chunks (e.g. '##', "
        "the format 'sys##doc1##doc2##question'); every prompt containing it "
        "is then chunked. Empty (the default): only requests with a 'chunks' "
        "field are chunked.",
    ),
    Option(
        "chunk_cache_device_fraction",
        parse_fraction,
        0.1,
        "Chunk-store capacity on the KV cache's device, as a fraction of the "
        "KV cache's size (memory on top of it).",
    ),
    Option(
        "chunk_cache_cpu_gib",
        parse_gib,
        0.0,
        "Chunk-store capacity in host memory (GiB) for chunks evicted from the "
        "device tier; 0 turns the CPU tier off.",
    ),
    Option(
        "chunk_cache_hash",
        choice_parser(*CHUNK_HASHES),
        "",
        "Hash of chunk content keys; empty (default) uses vLLM's "
        "--prefix-caching-hash-algo (sha256 unless set).",
    ),
    Option(
        "chunk_attention",
        choice_parser(*CHUNK_ATTENTION_MODES),
        "isolated",
        "'isolated': a chunk attends to itself only; 'system': chunks also see "
        "the system prompt (the first segment), whose hash joins their key.",
    ),
    Option(
        "chunk_recompute_fraction",
        parse_fraction,
        0.125,
        "Share of a chunked prompt's chunk tokens, taken from the end of its "
        "last chunk backwards, that is recomputed with full attention with the "
        "question instead of loaded from the store (1: full attention). The "
        "default, with --chunk-recompute-head 64, keeps the most answers at a "
        "warm TTFT >= 3x below plain vLLM (docs/chunk_cache.md).",
    ),
    Option(
        "chunk_recompute_head",
        parse_tokens,
        64,
        "Tokens at the start of every chunk but the first that are recomputed "
        "with the real preceding context instead of loaded (EPIC); each "
        "recomputed run costs the request one engine step.",
    ),
    Option(
        "chunk_recompute_select",
        parse_fraction,
        0.0,
        "Share of a chunked prompt's chunk tokens recomputed with full "
        "attention, spent on the chunks that share the most rare tokens with "
        "the question, each from its start (0: off).",
    ),
)
OPTIONS += (
    Option(
        "sid_catalog",
        parse_catalog_path,
        "",
        "SID catalog file (format: docs/sid_catalog.md), built at start-up "
        "into a trie that beam-search requests asking for it are constrained "
        "to. Empty (the default): no catalog.",
    ),
)
OPTIONS_BY_NAME: dict[str, Option] = {option.name: option for option in OPTIONS}


@dataclass(frozen=True, slots=True)
class KVReuseConfig:
    """Validated vllm-kvreuse settings; defaults change nothing in vLLM."""

    global_cache_hit_threshold: float | None = None
    enable_continuation: bool = False
    retain_kv_ttl: float = 60.0
    retain_kv_max_fraction: float = 0.25
    continuation_wait_timeout: float = 60.0
    engine_beam_search: bool = False
    enable_chunk_cache: bool = False
    chunk_separator: str = ""
    chunk_cache_device_fraction: float = 0.1
    chunk_cache_cpu_gib: float = 0.0
    chunk_cache_hash: str = ""
    chunk_attention: str = "isolated"
    chunk_recompute_fraction: float = 0.125
    chunk_recompute_head: int = 64
    chunk_recompute_select: float = 0.0
    sid_catalog: str = ""

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> KVReuseConfig:
        """Validates ``raw`` (the additional_config entry); unknown keys are errors."""
        unknown = set(raw) - set(OPTIONS_BY_NAME)
        if unknown:
            raise ValueError(
                f"unknown vllm-kvreuse setting(s) {sorted(unknown)} in "
                f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]; "
                f"known: {sorted(OPTIONS_BY_NAME)}"
            )
        values = {
            name: OPTIONS_BY_NAME[name].parse(value, name)
            for name, value in raw.items()
            if value is not None
        }
        return cls(**values)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> KVReuseConfig:
        """Reads the settings the frontend stored in ``vllm_config``."""
        additional = getattr(vllm_config, "additional_config", None) or {}
        if not isinstance(additional, Mapping):
            return cls()
        return cls.from_dict(additional.get(ADDITIONAL_CONFIG_KEY) or {})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def enabled(self) -> frozenset[str]:
        """The features switched on (``core`` is always there)."""
        switches = {
            "admission": self.global_cache_hit_threshold is not None,
            "continuation": self.enable_continuation,
            "beam": self.engine_beam_search,
            "chunk_cache": self.enable_chunk_cache,
        }
        return frozenset({"core"} | {name for name, on in switches.items() if on})


def merge_settings(
    additional_config: Mapping[str, Any] | None, settings: Mapping[str, Any]
) -> dict[str, Any]:
    """Returns a copy of ``additional_config`` with ``settings`` folded in.

    ``settings`` override entries the user put in
    ``additional_config["kvreuse"]`` directly. The result is validated, so a
    bad value fails here, at start-up, naming the setting.
    """
    merged = dict(additional_config or {})
    ours = {**(merged.get(ADDITIONAL_CONFIG_KEY) or {}), **settings}
    KVReuseConfig.from_dict(ours)  # validates
    merged[ADDITIONAL_CONFIG_KEY] = {
        name: OPTIONS_BY_NAME[name].parse(value, name)
        for name, value in ours.items()
        if value is not None
    }
    return merged


assert {f.name for f in fields(KVReuseConfig)} == set(OPTIONS_BY_NAME), (
    "KVReuseConfig fields and OPTIONS must list the same settings"
)
