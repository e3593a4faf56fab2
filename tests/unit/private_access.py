"""Finds every attribute access of the package, and whose attribute it is.

An access is ``obj.name`` (read, written, deleted or called), a name
imported from a module outside the package (``from x import _y``), or a
name given as a constant to ``getattr``/``setattr``/``hasattr``/``delattr``,
``object.__getattribute__``/``object.__setattr__``, ``vars(obj)[...]`` or
``obj.__dict__[...]`` (a name held in a module constant or iterated from
a literal tuple counts too; a name computed at run time cannot be read,
and is not checked).

Whose: a private name (``_x``, not a dunder) belongs to the package when

- it is read off ``self``/``cls``/``super()`` in a class of the package,
  some class of the package in that class's MRO defines it (a method, a
  class attribute, a slot, an annotation or a ``self._x =`` in its body),
  and no upstream class in that MRO defines it (a subclass of an upstream
  class can shadow upstream's private state without a single foreign
  ``obj._x``: the MRO is read on the real class, and each upstream class's
  ``self._x =`` assignments in its source);
- or it is read off another object, a class of the accessing module
  itself defines it (a module may use its own classes' private parts), and
  no upstream class the package imports defines it too (which object is
  meant cannot be told from the text: rename the package's);
- or it is read off a package module imported by name, which binds it at
  its top level.

Every other private name is upstream's (vLLM's, or a library's).

A public name belongs to the package when the object is ``self`` as above,
or a class the accessing module defines or imports from the package
defines it (``step.blocks`` beside a ``GroupStep`` import): public names
are guarded only where upstream state is meant (the seam's own, which the
test lists), and such a name is common.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import vllm_kvreuse

PACKAGE = Path(vllm_kvreuse.__file__).parent
ROOT = PACKAGE.name

_BY_NAME = {"getattr", "setattr", "hasattr", "delattr"}
_OBJECT_BY_NAME = {"__getattribute__", "__setattr__", "__delattr__"}


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


@dataclass(frozen=True, slots=True)
class Access:
    """One attribute access: ``receiver`` is ``self`` (also ``cls`` and
    ``super()``), ``module`` (a package module imported by name), ``import``
    (a name imported from outside the package) or ``other``;
    ``owner_class`` the enclosing class's qualname."""

    module: str
    line: int
    name: str
    receiver: str
    receiver_module: str | None
    owner_class: str | None
    store: bool
    call: bool

    def where(self) -> str:
        return f"{self.module}:{self.line} .{self.name}"


class _Visitor(ast.NodeVisitor):
    def __init__(self, module: str, tree: ast.Module) -> None:
        self.module = module
        self.found: list[Access] = []
        self._classes: list[str] = []
        self._loops: dict[str, list[str]] = {}
        self._constants = _module_constants(tree)
        self._imported = _imported_modules(tree, module)
        self._calls: set[int] = set()

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._classes.append(node.name)
        self.generic_visit(node)
        self._classes.pop()

    def visit_For(self, node: ast.For) -> None:
        names = _literal_strings(node.iter)
        if isinstance(node.target, ast.Name) and names is not None:
            self._loops[node.target.id] = names
        self.generic_visit(node)
        if isinstance(node.target, ast.Name):
            self._loops.pop(node.target.id, None)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        self._calls.add(id(func))
        if _names_an_attribute(func) and len(node.args) > 1:
            store = isinstance(func, ast.Name) and func.id in ("setattr", "delattr")
            for name in self._names(node.args[1]):
                self._add(node.args[0], name, node.lineno, store, False)
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        """``from upstream import _name``: a private name of another module."""
        if node.level == 0 and (node.module or "").split(".")[0] != ROOT:
            for alias in node.names:
                access = Access(
                    self.module, node.lineno, alias.name, "import", None,
                    None, False, False,
                )  # fmt: skip
                self.found.append(access)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        value = node.value
        namespace_of = None  # vars(obj)[...], obj.__dict__[...]
        if (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name)
            and value.func.id == "vars"
            and value.args
        ):
            namespace_of = value.args[0]
        elif isinstance(value, ast.Attribute) and value.attr == "__dict__":
            namespace_of = value.value
        if namespace_of is not None:
            store = not isinstance(node.ctx, ast.Load)
            for name in self._names(node.slice):
                self._add(namespace_of, name, node.lineno, store, False)
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        store = not isinstance(node.ctx, ast.Load)
        self._add(node.value, node.attr, node.lineno, store, id(node) in self._calls)
        self.generic_visit(node)

    def _names(self, node: ast.expr) -> list[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, ast.Name):
            if node.id in self._loops:
                return self._loops[node.id]
            if node.id in self._constants:
                return [self._constants[node.id]]
        return []

    def _add(
        self, receiver: ast.expr, name: str, line: int, store: bool, call: bool
    ) -> None:
        kind, of_module = "other", None
        if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
            kind = "self"
        elif (
            isinstance(receiver, ast.Call)
            and isinstance(receiver.func, ast.Name)
            and receiver.func.id == "super"
        ):
            kind = "super"
        elif isinstance(receiver, ast.Name) and receiver.id in self._imported:
            kind, of_module = "module", self._imported[receiver.id]
        owner = ".".join(self._classes) or None
        self.found.append(
            Access(self.module, line, name, kind, of_module, owner, store, call)
        )


def _names_an_attribute(func: ast.expr) -> bool:
    """``getattr`` and its kin, or ``object.__getattribute__`` and its kin:
    calls whose second argument is an attribute name."""
    if isinstance(func, ast.Name):
        return func.id in _BY_NAME
    return (
        isinstance(func, ast.Attribute)
        and func.attr in _OBJECT_BY_NAME
        and isinstance(func.value, ast.Name)
        and func.value.id == "object"
    )


def _literal_strings(node: ast.expr) -> list[str] | None:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and all(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts
    ):
        return [e.value for e in node.elts]  # type: ignore[attr-defined]
    return None


def _module_constants(tree: ast.Module) -> dict[str, str]:
    constants = {}
    for node in tree.body:
        if (
            isinstance(node, (ast.Assign, ast.AnnAssign))
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    constants[target.id] = node.value.value
    return constants


def _imported_modules(tree: ast.Module, module: str) -> dict[str, str]:
    """Local names bound to a package module (``from vllm_kvreuse.x import
    y`` where ``y`` is a module, ``import vllm_kvreuse.x as y``)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(ROOT):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if _is_package_module(full):
                    names[alias.asname or alias.name] = full
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(ROOT) and alias.asname:
                    names[alias.asname] = alias.name
    return names


def _is_package_module(name: str) -> bool:
    path = PACKAGE.parent / Path(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def accesses() -> Iterator[Access]:
    """Every attribute access in the package, in module order."""
    for path in modules():
        tree = ast.parse(path.read_text())
        visitor = _Visitor(module_name(path), tree)
        visitor.visit(tree)
        yield from visitor.found


# -- who defines a name ------------------------------------------------------------


def _class_names(node: ast.ClassDef) -> set[str]:
    """What a class body defines: methods, class attributes, annotations,
    slots, and ``self.x =`` (``cls.x =``) in its methods."""
    names: set[str] = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(item.name)
        elif isinstance(item, (ast.Assign, ast.AnnAssign)):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    names.add(target.id)
                    if target.id == "__slots__" and item.value is not None:
                        names |= set(_literal_strings(item.value) or ())
    for sub in ast.walk(node):
        targets: list[ast.expr] = []
        if isinstance(sub, ast.Assign):
            targets = sub.targets
        elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
            targets = [sub.target]
        for target in targets:
            for part in ast.walk(target):
                if (
                    isinstance(part, ast.Attribute)
                    and isinstance(part.value, ast.Name)
                    and part.value.id in ("self", "cls")
                ):
                    names.add(part.attr)
    return names


@functools.cache
def _parsed(module: str) -> ast.Module:
    path = PACKAGE.parent / Path(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    return ast.parse(path.read_text())


@functools.cache
def top_level_names(module: str) -> frozenset[str]:
    """Names a package module binds at its top level (what ``module.x`` reads)."""
    names: set[str] = set()
    for node in _parsed(module).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
    return frozenset(names)


@functools.cache
def class_attribute_names(module: str) -> frozenset[str]:
    """Attribute names the classes of a package module define."""
    names: set[str] = set()
    for node in ast.walk(_parsed(module)):
        if isinstance(node, ast.ClassDef):
            names |= _class_names(node)
    return frozenset(names)


@functools.cache
def known_attribute_names(module: str) -> frozenset[str]:
    """Attribute names of the package classes a module defines or imports
    by name (``from vllm_kvreuse.x import Class``)."""
    names = set(class_attribute_names(module))
    for node in ast.walk(_parsed(module)):
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        if node.module.split(".")[0] != ROOT or _is_package_module(
            f"{node.module}.{node.names[0].name}"
        ):
            continue
        imported = {alias.name for alias in node.names}
        for item in _parsed(node.module).body:
            if isinstance(item, ast.ClassDef) and item.name in imported:
                names |= _class_names(item)
    return frozenset(names)


@functools.cache
def defined_by(klass: type) -> frozenset[str]:
    """Names ``klass`` itself defines (its namespace, and its source's
    ``self.x =`` where the source can be read)."""
    names = set(vars(klass)) | set(getattr(klass, "__annotations__", {}))
    try:
        source = inspect.getsource(klass)
    except (OSError, TypeError):
        return frozenset(names)
    tree = ast.parse(textwrap.dedent(source))
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names |= _class_names(node)
    return frozenset(names)


def _class_of(module: str, qualname: str) -> type | None:
    obj: object = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) else None


@functools.cache
def upstream_private_names() -> frozenset[str]:
    """Private names of every class the package imports from outside it
    (``from x import Class``), and of their bases."""
    names: set[str] = set()
    for path in modules():
        for node in ast.walk(_parsed(module_name(path))):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            if node.module.split(".")[0] == ROOT:
                continue
            try:
                module = importlib.import_module(node.module)
            except ImportError:  # another platform's (torch_npu): not loaded here
                continue
            for alias in node.names:
                obj = getattr(module, alias.name, None)
                for klass in obj.__mro__ if isinstance(obj, type) else ():
                    names |= {n for n in defined_by(klass) if is_private(n)}
    return frozenset(names)


def _other_owned(access: Access) -> bool:
    name = access.name
    if is_private(name):
        return (
            name in class_attribute_names(access.module)
            and name not in upstream_private_names()
        )
    return name in known_attribute_names(access.module)


def owned_by_package(access: Access) -> bool:
    """Whether the package defines ``access.name`` for the object it is read
    off (the module docstring's rule). Off another object, a name that an
    upstream class the package imports also defines is never the package's:
    which one is meant cannot be told."""
    name = access.name
    if access.receiver == "import":  # a name imported from outside the package
        return False
    if access.receiver == "module":
        return name in top_level_names(access.receiver_module or "")
    if access.receiver == "other" or access.owner_class is None:
        return _other_owned(access)
    klass = _class_of(access.module, access.owner_class)
    if klass is None:  # a class made at run time: as another object
        return _other_owned(access)
    mro = klass.__mro__[1:] if access.receiver == "super" else klass.__mro__
    ours = [k for k in mro if k.__module__.split(".")[0] == ROOT]
    theirs = [k for k in mro if k.__module__.split(".")[0] not in (ROOT, "builtins")]
    return any(name in defined_by(k) for k in ours) and not any(
        name in defined_by(k) for k in theirs
    )
