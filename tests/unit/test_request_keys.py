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
