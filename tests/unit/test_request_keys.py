"""Internal request keys are defined and sealed in core, once; features
build what they write from those constants, and a feature writes only its
own keys (a continuation child carries its parent's chunk lengths because
the chunk cache marks them ``inherited``, not because continuation names
them)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import vllm_kvreuse
from vllm_kvreuse.core import request_keys
from vllm_kvreuse.core.request_keys import (
    CHUNKS,
    INTERNAL,
    PARENT,
    carried,
    is_sealed,
    seal,
)
from vllm_kvreuse.core.spec import ArgKey, inherited_keys
from vllm_kvreuse.features import SPECS
from vllm_kvreuse.request_args import TABLE, KeyTable

PACKAGE = Path(vllm_kvreuse.__file__).parent
CLIENTS = PACKAGE / "testing"
"""Test helpers that send what a client would (hostile bodies spell keys)."""


def _spelled(path: Path) -> list[str]:
    """Internal key names a module spells: string constants (docstrings
    aside) and keyword arguments."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    found = [
        f"{path.relative_to(PACKAGE)}:{node.lineno} {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and node.value in INTERNAL
        and id(node) not in docstrings
    ]
    found += [
        f"{path.relative_to(PACKAGE)}:{node.value.lineno} {node.arg}="
        for node in ast.walk(tree)
        if isinstance(node, ast.keyword) and node.arg in INTERNAL
    ]
    return found


def test_internal_keys_are_spelled_only_in_core() -> None:
    spelled = [
        place
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != Path(request_keys.__file__) and CLIENTS not in path.parents
        for place in _spelled(path)
    ]
    assert spelled == [], "use the constants of core/request_keys.py"


def test_every_internal_key_of_the_table_is_cores() -> None:
    internal = {key.name for key in TABLE.keys if not key.public}
    assert internal == INTERNAL


def test_an_internal_key_defined_elsewhere_is_refused() -> None:
    stray = ArgKey("kvreuse_stray", SPECS[0].name, False, str, "nowhere")
    spec = dataclasses.replace(SPECS[0], keys=(*SPECS[0].keys, stray))
    with pytest.raises(AssertionError, match=r"core/request_keys\.py"):
        KeyTable((spec, *SPECS[1:]))


def test_seal_takes_internal_keys_only() -> None:
    sealed = seal({CHUNKS: [4, 4]})
    assert is_sealed(sealed) and sealed[CHUNKS] == [4, 4]
    assert not is_sealed({CHUNKS: [4, 4]})
    with pytest.raises(AssertionError, match="not internal keys"):
        seal({"retain_kv": True})


def test_a_child_carries_what_its_parents_owners_mark() -> None:
    """The chunk cache marks its chunk lengths; nothing else is carried."""
    keys = inherited_keys(SPECS)
    assert keys == {CHUNKS}
    parent = {CHUNKS: [8, 8], PARENT: "p", "retain_kv": True}
    assert carried(parent, keys) == {CHUNKS: [8, 8]}
    assert carried({CHUNKS: None}, keys) == {}


# -- parsed once, in the frontend ------------------------------------------------


ALL_ON = frozenset({"core", *(spec.name for spec in SPECS)})
SENT = {
    "cache_hit_threshold": "0.25",
    "retain_kv": True,
    "retain_kv_ttl": "30",
    "chunk_attention": "paths",
    "chunk_recompute": "none",
}
"""Public keys as a client may send them (numbers as strings, a shorthand)."""
CARRIED = {
    "cache_hit_threshold": 0.25,
    "retain_kv": True,
    "retain_kv_ttl": 30.0,
    "chunk_attention": "paths",
    "chunk_recompute": {"head": 0, "select": 0.0, "tail": 0.0},
}
"""The same keys as the engine reads them."""
ALL_ENABLED = {
    "enable_chunk_cache": True,
    "enable_continuation": True,
    "global_cache_hit_threshold": 0.0,
}
"""Settings that switch on every feature whose public key ``SENT`` names."""


def test_validation_carries_each_key_parsed_to_the_engine() -> None:
    """The frontend's validation parses each key into what the request
    carries (the engine reads it as it is); parsed again, it is the same."""
    assert TABLE.validate(SENT, ALL_ON) == CARRIED
    assert TABLE.validate(CARRIED, ALL_ON) == CARRIED, "carried parses to itself"
    beam = {"width": 2, "max_tokens": 3, "eos_token_id": None}
    internal = seal({"kvreuse_beam": beam, CHUNKS: (3, 4)})
    parsed = TABLE.validate(internal, ALL_ON)
    assert parsed["kvreuse_beam"]["length_penalty"] == 1.0, "defaults filled in"
    assert parsed[CHUNKS] == [3, 4]


def test_a_request_carries_its_keys_parsed() -> None:
    """Through the ``InputProcessor._validate_params`` patch: the request's
    params carry the parsed keys in a new dict; the caller's is untouched."""
    from types import SimpleNamespace

    from vllm.sampling_params import SamplingParams

    from vllm_kvreuse.config import KVReuseConfig
    from vllm_kvreuse.frontend import wrap_validate_params

    sent = {**SENT, "not_ours": "x"}
    params = SamplingParams(max_tokens=1, extra_args=sent)
    config = SimpleNamespace(kvreuse_settings=KVReuseConfig.from_dict(ALL_ENABLED))
    wrap_validate_params(lambda *_: None)(SimpleNamespace(vllm_config=config), params)
    assert params.extra_args == {**CARRIED, "not_ours": "x"}
    assert sent == {**SENT, "not_ours": "x"}


PARSER_CALLERS = ("spec.py", "request_args.py", "request_keys.py", "frontend")
"""Where a key's parser may be named besides its own module: the specs that
declare it, the table that runs it, and the frontends (their own input)."""


def test_the_engine_never_parses_a_key_again() -> None:
    """No module but the parser's own, the specs, the key table and the
    frontends names a key's parser: the engine side reads carried values."""
    parsers = {key.parse.__name__ for key in TABLE.keys}
    parsers |= {"parse_recompute", "validate_lengths"}
    named: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if any(part in where for part in PARSER_CALLERS):
            continue
        tree = ast.parse(path.read_text())
        defined = {
            node.name
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        named += [
            f"{where}:{node.lineno} {name}"
            for node in ast.walk(tree)
            if (name := getattr(node, "id", None) or getattr(node, "attr", None))
            in parsers - defined
        ]
    assert named == [], "read the value the frontend carried instead"
