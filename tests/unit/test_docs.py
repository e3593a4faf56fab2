"""Docs name every flag, every patch, every test file and every module, so
they cannot drift from the code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import vllm_kvreuse
from vllm_kvreuse.config import OPTIONS
from vllm_kvreuse.patches import PATCHES

DOCS = Path(__file__).resolve().parents[2] / "docs"
PACKAGE = Path(vllm_kvreuse.__file__).parent


def test_architecture_lists_every_patch() -> None:
    text = (DOCS / "architecture.md").read_text()
    missing = [p.target for p in PATCHES if f"`{p.target.split(':')[1]}`" not in text]
    assert missing == [], "add these patches to docs/architecture.md"


def test_every_flag_is_documented() -> None:
    text = "".join(page.read_text() for page in DOCS.glob("*.md"))
    missing = [option.flag for option in OPTIONS if option.flag not in text]
    assert missing == [], "document these flags in docs/"


def test_runners_table_lists_every_test_file() -> None:
    """docs/architecture.md says under which runner(s) each test file runs."""
    text = (DOCS / "architecture.md").read_text()
    table = text[text.index("### The test tiers") : text.index("## Platforms")]
    tests = DOCS.parent / "tests"
    missing = [
        path.relative_to(tests.parent).as_posix()
        for path in sorted(tests.rglob("test_*.py"))
        if f"`{path.relative_to(tests.parent).as_posix()}`" not in table
    ]
    assert missing == [], "add these test files to the Runners table"


# A module of the package as its docstring names it: ``name.py`` or
# :mod:`.name`; a subpackage: ``name/`` or :mod:`.name`. Paths into other
# folders (``testing/x.py``) and absolute :mod: references are not counted.
_NAMED = re.compile(r"``(\w+)(?:\.py|/)``|:mod:`\.(\w+)`")


def _named_in(docstring: str) -> set[str]:
    return {a or b for a, b in _NAMED.findall(docstring)}


@pytest.mark.parametrize(
    "init",
    sorted(PACKAGE.rglob("*/__init__.py")),
    ids=lambda path: path.parent.relative_to(PACKAGE).as_posix(),
)
def test_package_docstring_lists_its_modules(init: Path) -> None:
    """Each subpackage's docstring names every module and subpackage in it,
    and no module that is not there."""
    folder = init.parent
    docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
    present = {path.stem for path in folder.glob("*.py")} - {"__init__"}
    present |= {path.parent.name for path in folder.glob("*/__init__.py")}
    named = _named_in(docstring)
    assert sorted(present - named) == [], f"describe these in {init}"
    assert sorted(named - present) == [], f"{init} names these, which are gone"
