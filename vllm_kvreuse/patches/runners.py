"""Patches of the model runners' samplers: the beam step next to the logits.

Each entry names its runner (``Patch.runner``): a worker applies only the
entries of the runner it builds. The wrappers live in
:mod:`vllm_kvreuse.beam.worker.runner_hooks`.
"""

from __future__ import annotations

from vllm_kvreuse.patches.registry import V0_32_0, Patch

_HOOKS = "vllm_kvreuse.beam.worker.runner_hooks"
_WHY = (
    "Engine beam search ranks a group's W x V candidates: through vLLM's "
    "sampler each member's row would come back as its top W (2W with EOS) "
    "log-probs, per-row Python lists, ranked on the host; at W = 512 that "
    "was most of a step outside the model."
)
_REMOVE = "vLLM runs beam search groups in its sampler (a per-request beam_width)."

PATCHES: tuple[Patch, ...] = (
    Patch(
        target="vllm.v1.sample.sampler:Sampler.forward",
        wrapper=f"{_HOOKS}:wrap_v1_sampler_forward",
        kind="function",
        runner="v1",
        signatures={
            V0_32_0: "(self, logits: torch.Tensor, sampling_metadata: "
            "vllm.v1.sample.metadata.SamplingMetadata, predict_bonus_token: bool "
            "= False, logprobs_mode_override: Optional[Literal['raw_logits', "
            "'raw_logprobs', 'processed_logits', 'processed_logprobs']] = None) "
            "-> vllm.v1.outputs.SamplerOutput"
        },
        why=_WHY,
        how="With a beam job on the sampler (set by sample_tokens for a step "
        "that schedules groups): copies the groups' raw logits rows, calls the "
        "original, then selects each group's next beams on the device and "
        "overwrites its rows' sampled tokens with the chosen ones; otherwise "
        "the original alone.",
        remove_when=_REMOVE,
    ),
    Patch(
        target="vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens",
        wrapper=f"{_HOOKS}:wrap_v1_sample_tokens",
        kind="function",
        runner="v1",
        signatures={
            V0_32_0: "(self, grammar_output: 'GrammarOutput | None') -> "
            "vllm.v1.outputs.ModelRunnerOutput | vllm.v1.outputs."
            "AsyncModelRunnerOutput | vllm.sequence.IntermediateTensors"
        },
        why=_WHY + " The sampler sees neither the scheduler output nor the "
        "request ids of its rows, and its output carries no beam results.",
        how="When the step's scheduler output names beam groups: puts a job "
        "(the groups, the rows by request id) on the sampler, calls the "
        "original, and puts the job's packed results on the ModelRunnerOutput "
        "(the one an async output wraps).",
        remove_when=_REMOVE,
    ),
    Patch(
        target="vllm.v1.worker.gpu.sample.sampler:Sampler.__call__",
        wrapper=f"{_HOOKS}:wrap_v2_sampler_call",
        kind="function",
        runner="v2",
        signatures={
            V0_32_0: "(self, logits: torch.Tensor, input_batch: "
            "vllm.v1.worker.gpu.input_batch.InputBatch) -> "
            "vllm.v1.worker.gpu.sample.output.SamplerOutput"
        },
        why=_WHY,
        how="As the V1 Sampler.forward entry, the rows from input_batch.req_ids.",
        remove_when=_REMOVE,
    ),
    Patch(
        target="vllm.v1.worker.gpu.model_runner:GPUModelRunner.update_requests",
        wrapper=f"{_HOOKS}:wrap_v2_update_requests",
        kind="function",
        runner="v2",
        signatures={
            V0_32_0: "(self, scheduler_output: "
            "vllm.v1.core.sched.output.SchedulerOutput) -> None"
        },
        why="V2's sample_tokens has no scheduler output; update_requests is "
        "called with it once per step, before the forward.",
        how="Calls the original, then keeps the step's beam groups on the runner.",
        remove_when=_REMOVE,
    ),
    Patch(
        target="vllm.v1.worker.gpu.model_runner:GPUModelRunner.sample_tokens",
        wrapper=f"{_HOOKS}:wrap_v2_sample_tokens",
        kind="function",
        runner="v2",
        signatures={
            V0_32_0: "(self, grammar_output: vllm.v1.core.sched.output."
            "GrammarOutput | None) -> vllm.v1.worker.gpu.async_utils.AsyncOutput "
            "| vllm.v1.outputs.ModelRunnerOutput | None"
        },
        why="As the V1 sample_tokens entry.",
        how="With groups kept by update_requests: as the V1 entry (the results "
        "on the AsyncOutput's model_runner_output).",
        remove_when=_REMOVE,
    ),
)
