"""The package stays readable at once: no file of ``vllm_kvreuse/`` over 350
lines, no function over 60 (a function counts from its ``def`` to its last
line, docstring included)."""

from __future__ import annotations

import ast
from pathlib import Path

import vllm_kvreuse

PACKAGE = Path(vllm_kvreuse.__file__).parent
MAX_FILE_LINES = 350
MAX_FUNCTION_LINES = 60


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_file_is_over_350_lines() -> None:
    long = {
        path.relative_to(PACKAGE).as_posix(): num_lines
        for path in _modules()
        if (num_lines := len(path.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert long == {}, "split these files: one concept a file"


def test_no_function_is_over_60_lines() -> None:
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                num_lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if num_lines > MAX_FUNCTION_LINES:
                    where = f"{path.relative_to(PACKAGE).as_posix()}:{node.lineno}"
                    long[f"{where} {node.name}"] = num_lines
    assert long == {}, "split these functions: short enough to read at once"
