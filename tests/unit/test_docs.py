"""Docs name every flag, every patch, every test file and every module, so
they cannot drift from the code."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from vllm import envs
from vllm.plugins import (
    DEFAULT_PLUGINS_GROUP,
    ENDPOINT_PLUGINS_GROUP,
    PLATFORM_PLUGINS_GROUP,
    load_plugins_by_group,
)

import vllm_kvreuse
from vllm_kvreuse.config import OPTIONS
from vllm_kvreuse.patches import PATCHES

DOCS = Path(__file__).resolve().parents[2] / "docs"
PACKAGE = Path(vllm_kvreuse.__file__).parent

FEATURE_PAGES = (
    "chunk_cache.md",
    "answer_modes.md",
    "continuation.md",
    "engine_beam_search.md",
    "sid_catalog.md",
    "cache_hit_threshold.md",
)
"""The pages that document a feature for its users."""

_RUNS = re.compile(
    r"^<!-- runs -->\n```(bash|python)\n(.*?)^```", re.MULTILINE | re.DOTALL
)


def runnable_examples() -> list[tuple[str, str, str]]:
    """(page, language, code) of every block the feature pages mark
    ``<!-- runs -->``: it runs as printed against the server
    ``scripts/serve.sh`` starts (``tests/e2e/test_serve_script.py`` runs
    them); a ``# expect: X`` line says that the output above it contains X."""
    return [
        (page, lang, code)
        for page in FEATURE_PAGES
        for lang, code in _RUNS.findall((DOCS / page).read_text())
    ]


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


VLLM_ASCEND_ENTRY_POINTS = {
    PLATFORM_PLUGINS_GROUP: ["ascend"],
    DEFAULT_PLUGINS_GROUP: [
        "ascend_kv_connector",
        "ascend_model_loader",
        "ascend_service_profiling",
        "ascend_model",
    ],
}
"""vllm-ascend v0.23.0's entry points (its setup.py), as docs/ascend.md lists them."""


def _loaded(group: str, allowlist: str, monkeypatch: pytest.MonkeyPatch) -> set[str]:
    monkeypatch.setenv("VLLM_PLUGINS", allowlist)
    return set(load_plugins_by_group(group))


def test_ascend_plugin_allowlist_keeps_vllm_ascend_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every ``VLLM_PLUGINS=`` command in docs/ascend.md, fed to vLLM's own
    filter next to an installed distribution with vllm-ascend's entry-point
    names, loads all of them and both of kvreuse's; ``kvreuse`` alone drops
    the platform, as the page says."""
    dist = tmp_path / "fake_vllm_ascend-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-vllm-ascend\n")
    (dist / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{name} = os:getcwd\n" for name in names)
            for group, names in VLLM_ASCEND_ENTRY_POINTS.items()
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    envs.disable_envs_cache()  # VLLM_PLUGINS is read per call below

    assert "ascend" not in _loaded(PLATFORM_PLUGINS_GROUP, "kvreuse", monkeypatch)
    commands = re.findall(
        r"^VLLM_PLUGINS=(\S+)", (DOCS / "ascend.md").read_text(), re.MULTILINE
    )
    assert commands, "docs/ascend.md has no VLLM_PLUGINS= command"
    for allowlist in commands:
        for group, names in VLLM_ASCEND_ENTRY_POINTS.items():
            missing = set(names) - _loaded(group, allowlist, monkeypatch)
            assert not missing, f"VLLM_PLUGINS={allowlist} drops {missing}"
        for group in (DEFAULT_PLUGINS_GROUP, ENDPOINT_PLUGINS_GROUP):
            assert "kvreuse" in _loaded(group, allowlist, monkeypatch), allowlist


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


def _layout_rows() -> dict[str, str]:
    """docs/architecture.md's Layout table: path -> what it says."""
    text = (DOCS / "architecture.md").read_text()
    table = text[text.index("## Layout") : text.index("## Patch registry")]
    rows = re.findall(r"^\| `vllm_kvreuse/([^`]*)` \| (.*) \|$", table, re.MULTILINE)
    return dict(rows)


def test_layout_table_lists_every_top_level_module_and_folder() -> None:
    """Each module and subpackage of ``vllm_kvreuse/`` has a row."""
    present = {path.name for path in PACKAGE.glob("*.py")}
    present |= {f"{path.parent.name}/" for path in PACKAGE.glob("*/__init__.py")}
    assert sorted(present - set(_layout_rows())) == [], "add rows to Layout"


def test_layout_table_names_no_file_that_is_gone() -> None:
    """A folder's row names only files that are in the folder."""
    gone = [
        f"{folder}{name}"
        for folder, what in _layout_rows().items()
        if folder.endswith("/")
        for name in re.findall(r"`(\w+\.py)`", what)
        if not (PACKAGE / folder / name).exists()
    ]
    assert gone == [], "drop these from the Layout table"


def _blocks(page: str, lang: str) -> list[str]:
    text = (DOCS / page).read_text()
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


@pytest.mark.parametrize("page", FEATURE_PAGES)
def test_python_examples_compile(page: str) -> None:
    for code in _blocks(page, "python"):
        compile(code, f"docs/{page}", "exec")


# A shell word spliced into a single-quoted body ('"$ID"') stands for a string.
_SPLICE = re.compile(r"""'"\$\{?\w+\}?"'""")


@pytest.mark.parametrize("page", FEATURE_PAGES)
def test_curl_bodies_of_runnable_examples_are_json(page: str) -> None:
    codes = [code for name, _, code in runnable_examples() if name == page]
    for code in codes:
        for body in re.findall(r"-d '(.*?)'", _SPLICE.sub("X", code), re.DOTALL):
            json.loads(body)


def test_every_feature_page_but_the_catalog_has_a_runnable_example() -> None:
    """The SID catalog needs a catalog file that scripts/serve.sh's server
    does not load; every other feature page shows one example that runs."""
    pages = {page for page, _, _ in runnable_examples()}
    assert pages == set(FEATURE_PAGES) - {"sid_catalog.md"}
    assert all(lang in ("bash", "python") for _, lang, _ in runnable_examples())
