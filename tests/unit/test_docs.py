"""Docs name every flag and every patch, so they cannot drift from the code."""

from __future__ import annotations

from pathlib import Path

from vllm_kvreuse.config import OPTIONS
from vllm_kvreuse.patches import PATCHES

DOCS = Path(__file__).resolve().parents[2] / "docs"


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
