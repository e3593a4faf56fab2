"""The package's imports run one way: no circle between its folders and
top-level modules, so none runs up, and no circle between its modules.

Computed from the code itself (the AST of every module, each ``import``
and ``from ... import`` of the package, inside functions and under
``TYPE_CHECKING`` too: a type is a dependency), with the package's rooms
as ``farm-studio look vllm_kvreuse`` draws them: each top-level module
(``config.py``) and each top-level folder (``beam/``). With no circle the
rooms stack in floors, every import pointing down; an import in a circle
is one that runs up. Hooks named by path (``"module:function"`` in a
spec, loaded by :func:`vllm_kvreuse.core.spec.load_hook`) are not imports:
they are how the list names what sits above it.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import vllm_kvreuse

PACKAGE = Path(vllm_kvreuse.__file__).parent
ROOT = PACKAGE.name

Edges = dict[str, dict[str, list[str]]]
"""From each node, to each node it imports: where (``file:line``)."""


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = PACKAGE.parent / Path(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imported(path: Path) -> Iterator[tuple[str, int]]:
    """Each package module ``path`` imports, with the line: ``from a import
    b`` imports ``a.b`` where that is a module, else ``a``."""
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield (full if _is_module(full) else base), node.lineno


def _room(module: str) -> str:
    """``config.py``, ``beam/``, or ``__init__.py`` for the package itself."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__.py"
    return f"{parts[1]}/" if (PACKAGE / parts[1]).is_dir() else f"{parts[1]}.py"


def import_graph(node_of: Callable[[str], str] = _room) -> Edges:
    edges: Edges = defaultdict(lambda: defaultdict(list))
    for path in sorted(PACKAGE.rglob("*.py")):
        source = node_of(_module(path))
        for name, line in _imported(path):
            if name.split(".")[0] != ROOT or name == ROOT:
                continue
            target = node_of(name)
            if target != source:
                edges[source][target].append(f"{path.relative_to(PACKAGE)}:{line}")
    return edges


def circles(edges: Edges) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in list(edges):
        if node not in index:
            visit(node)
    return found


def _explain(edges: Edges, found: list[list[str]]) -> str:
    return "\n".join(
        f"{source} -> {target}: {', '.join(where)}"
        for component in found
        for source in component
        for target, where in sorted(edges[source].items())
        if target in component
    )


def test_no_import_runs_up_between_folders_and_top_level_modules() -> None:
    """Each folder and top-level module imports only rooms below it: the
    features' folders take their settings from the ``VllmConfig`` that
    carries them (``core.spec.settings_of``), so nothing below the settings
    table (``config.py``, over the list ``features.py``) imports it."""
    edges = import_graph()
    assert "beam/" in edges["features.py"], "the scan sees no imports"
    assert "features.py" in edges["config.py"]
    found = circles(edges)
    assert not found, "imports in a circle (one runs up):\n" + _explain(edges, found)


def test_no_circle_between_modules() -> None:
    edges = import_graph(node_of=lambda module: module)
    assert "vllm_kvreuse.core.context" in edges["vllm_kvreuse.core.layer"]
    found = circles(edges)
    assert not found, "modules importing each other:\n" + _explain(edges, found)
