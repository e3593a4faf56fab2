"""Model-runner state the beam step reads, per runner and vLLM release.

Not patches: nothing here is replaced. The runners' sampler patches
(:mod:`vllm_kvreuse.beam.worker.runner_hooks`, the only module that reads these)
need the step's scheduler output, the logits rows' request ids, the
sampler, the KV caches and the output they put results on. Each entry
names its owner class, why, and per supported release the method's
signature or :data:`~vllm_kvreuse.patches.upstream_state.ATTRIBUTE`
(present on a live instance, or a field of the class).
``tests/integration/test_runner_tier.py`` checks every entry of a tier's
runner on a live worker; ``tests/unit/test_upstream_state.py`` that
``runner_hooks`` reads nothing unlisted.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kvreuse.patches.registry import V0_32_0, Runner
from vllm_kvreuse.patches.upstream_state import ATTRIBUTE, UpstreamState


@dataclass(frozen=True, slots=True)
class RunnerState(UpstreamState):
    """One runner-side attribute (an :class:`UpstreamState` of ``runner``'s
    code): ``target`` is ``"module:Owner.attr"``."""

    runner: Runner = "v1"


_V1 = "vllm.v1.worker.gpu_model_runner"
_V2 = "vllm.v1.worker.gpu"


HOOKS = "vllm_kvreuse.beam.worker.runner_hooks"
"""The one module that reads runner state: the runners' sampler patches."""


def _v1(target: str, why: str) -> RunnerState:
    return RunnerState(target, why, {V0_32_0: ATTRIBUTE}, HOOKS, "v1")


def _v2(target: str, why: str) -> RunnerState:
    return RunnerState(target, why, {V0_32_0: ATTRIBUTE}, HOOKS, "v2")


RUNNER_STATE: tuple[RunnerState, ...] = (
    _v1(f"{_V1}:GPUModelRunner.execute_model_state", "the step's scheduler output"),
    _v1(f"{_V1}:ExecuteModelState.scheduler_output", "(its field)"),
    _v1(f"{_V1}:GPUModelRunner.input_batch", "which logits row is which request"),
    _v1("vllm.v1.worker.gpu_input_batch:InputBatch.req_id_to_index", "(its map)"),
    _v1(f"{_V1}:GPUModelRunner.sampler", "the sampler gets the step's beam job"),
    _v1(f"{_V1}:GPUModelRunner.vllm_config", "the SID catalog's settings"),
    _v1(f"{_V1}:GPUModelRunner.device", "the catalog on the logits' device"),
    _v1(f"{_V1}:GPUModelRunner.kv_caches", "a moved beam's KV blocks are copied"),
    _v1(f"{_V1}:GPUModelRunner.kv_cache_config", "(the pool's block count)"),
    _v1(
        f"{_V1}:AsyncGPUModelRunnerOutput._model_runner_output",
        "async scheduling: the output the results ride on",
    ),
    _v1("vllm.v1.outputs:SamplerOutput.sampled_token_ids", "carriers' tokens set"),
    _v1(
        "vllm.v1.sample.metadata:SamplingMetadata.all_greedy",
        "a beam-only step skips the sampler: a greedy draw is read by nobody",
    ),
    _v1(
        "vllm.v1.sample.metadata:SamplingMetadata.max_num_logprobs",
        "(no skip when a row asks for log-probs)",
    ),
    _v1(
        "vllm.v1.sample.metadata:SamplingMetadata.logprob_token_ids",
        "(nor for a row's chosen tokens' log-probs)",
    ),
    _v2(f"{_V2}.model_runner:GPUModelRunner.sampler", "as V1's"),
    _v2(f"{_V2}.model_runner:GPUModelRunner.vllm_config", "as V1's"),
    _v2(f"{_V2}.model_runner:GPUModelRunner.device", "as V1's"),
    _v2(f"{_V2}.model_runner:GPUModelRunner.kv_caches", "as V1's"),
    _v2(f"{_V2}.model_runner:GPUModelRunner.kv_cache_config", "as V1's"),
    _v2(f"{_V2}.input_batch:InputBatch.req_ids", "which logits row is which request"),
    _v2(
        f"{_V2}.async_utils:AsyncOutput.model_runner_output",
        "the output the results ride on",
    ),
    _v2(f"{_V2}.sample.output:SamplerOutput.sampled_token_ids", "as V1's"),
)
"""Every runner attribute :mod:`vllm_kvreuse.beam.worker.runner_hooks` reads."""
