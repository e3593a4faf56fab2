"""Every place where vllm-kvreuse replaces an upstream vLLM symbol.

vLLM's extension points (general plugins, ``scheduler_cls``,
``SamplingParams.extra_args``, ``additional_config``) carry most of the
plugin; what they cannot reach is patched in this package and only here. Each entry
names its target, why it exists, how it works, and what upstream change
would let us delete it.

- ``registry.py``: how a patch is described, applied and checked;
- ``startup.py``: the plugin's settings into vLLM, the scheduler choice;
- ``serving.py``: the OpenAI server and the ``LLM`` API: request fields,
  renderers, outputs;
- ``engine.py``: the engine clients, the engine core and the workers;
- ``runners.py``: both model runners' samplers run beam groups' steps;
- ``upstream_state.py``: not patches: the private (or seam-owned) upstream
  attributes the plugin reads or changes, each through its one seam
  (a module of :mod:`vllm_kvreuse.core.upstream`, one a side, or a
  registered patch's own module),
  checked per release on real objects (``tests/unit/test_upstream_state.py``)
  and against the package's code (``tests/unit/test_private_access.py``);
- ``runner_state.py``: not patches either: the model-runner attributes the
  beam step reads (:mod:`vllm_kvreuse.beam.worker.runner_hooks`), checked on live
  workers of each runner (``tests/integration/test_runner_tier.py``).

Rules:
- A patch wraps the original (kept as ``__wrapped__``) and calls it; none
  copies an upstream body.
- :func:`apply_all` is idempotent and runs in every process that loads the
  plugin (API server, engine core, workers). It leaves out patches of one
  model runner's code (``Patch.runner``): a worker applies those of the
  runner it builds (:func:`apply_for_runner`, called when the worker is
  initialised, where vLLM's config says which runner it will be).
- ``signatures`` holds the original's signature in each supported vLLM
  release (:data:`vllm_kvreuse.compat.SUPPORTED_VLLM`);
  ``tests/unit/test_patches.py`` checks the installed release's, requires one
  for every supported release, and checks that no module patches vLLM
  outside this table.
"""

from __future__ import annotations

from vllm_kvreuse.patches import engine, runners, serving, startup
from vllm_kvreuse.patches.registry import (
    ABSENT,
    V0_32_0,
    Patch,
    Runner,
    is_patched,
    signature_of,
)
from vllm_kvreuse.patches.startup import SCHEDULER_OVERRIDES
from vllm_kvreuse.patches.upstream_state import UPSTREAM_STATE, UpstreamState

__all__ = [
    "ABSENT",
    "PATCHES",
    "SCHEDULER_OVERRIDES",
    "UPSTREAM_STATE",
    "V0_32_0",
    "Patch",
    "Runner",
    "UpstreamState",
    "apply_all",
    "apply_for_runner",
    "is_patched",
    "signature_of",
]

PATCHES: tuple[Patch, ...] = (
    *startup.PATCHES,
    *serving.PATCHES,
    *engine.PATCHES,
    *runners.PATCHES,
)


def apply_all() -> list[str]:
    """Applies every runner-independent patch not yet applied in this
    process; returns their targets."""
    return [p.target for p in PATCHES if p.runner is None and p.apply()]


def apply_for_runner(runner: Runner) -> list[str]:
    """Applies the patches of ``runner``'s code not yet applied in this
    process; returns their targets. Those of the other runner stay off."""
    return [p.target for p in PATCHES if p.runner == runner and p.apply()]
