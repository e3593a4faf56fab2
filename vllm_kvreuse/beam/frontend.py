"""Frontend side of engine-side beam search (``--engine-beam-search``).

Replaces vLLM's front-end beam-search loop (one engine request per beam per
step, re-sent from the API server) by a single root request; the engine runs
the steps (:mod:`vllm_kvreuse.beam.scheduler`) and returns the best beams in
the root's final output, which is turned into the same ``RequestOutput``
the front-end loop yields. Off by default; with the flag off the original
loop runs unchanged.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

from vllm import CompletionOutput, RequestOutput
from vllm.sampling_params import BeamSearchParams, SamplingParams

from vllm_kvreuse.beam.policy import CONFIG_KEY, BeamConfig
from vllm_kvreuse.beam.scheduler import RESULT_KEY
from vllm_kvreuse.config import KVReuseConfig
from vllm_kvreuse.metrics import count_beam_group


def root_sampling_params(
    params: BeamSearchParams, eos_token_id: int | None
) -> SamplingParams:
    """The root request's params: one step of the front end's own per-beam params."""
    config = BeamConfig(
        width=params.beam_width,
        max_tokens=params.max_tokens,
        eos_token_id=eos_token_id,
        length_penalty=params.length_penalty,
        ignore_eos=params.ignore_eos,
        include_stop_str_in_output=params.include_stop_str_in_output,
    )
    return SamplingParams(
        logprobs=2 * params.beam_width,
        max_tokens=1,
        temperature=params.temperature,
        watermarking=False,
        detokenize=False,
        extra_args={CONFIG_KEY: config.to_dict()},
    )


def beam_output(
    final: RequestOutput, prompt: Any, params: BeamSearchParams, tokenizer: Any
) -> RequestOutput:
    """The front-end loop's ``RequestOutput`` from the engine's beams."""
    result = final.kv_transfer_params or {}
    beams = result.get(RESULT_KEY)
    if beams is None:  # rejected or aborted: pass the engine's answer on
        return final
    count_beam_group(result["forks"], result["copied_blocks"])
    eos = tokenizer.eos_token_id
    outputs = []
    for index, beam in enumerate(beams):
        token_ids = beam["token_ids"]
        shown = (
            token_ids[:-1]
            if token_ids and token_ids[-1] == eos and not params.ignore_eos
            else token_ids
        )
        outputs.append(
            CompletionOutput(
                index=index,
                text=tokenizer.decode(
                    shown, skip_special_tokens=params.skip_special_tokens
                ),
                token_ids=token_ids,
                cumulative_logprob=beam["cum_logprob"],
                logprobs=None,
                finish_reason=beam["finish_reason"],
                stop_reason=beam["stop_reason"],
            )
        )
    return RequestOutput(
        request_id=final.request_id,
        prompt=prompt.get("prompt"),
        prompt_token_ids=prompt["prompt_token_ids"],
        prompt_logprobs=None,
        outputs=outputs,
        finished=True,
        num_cached_tokens=final.num_cached_tokens,
    )


def wrap_beam_search(original: Callable[..., Any]) -> Callable[..., Any]:
    async def beam_search(
        self: Any,
        prompt: Any,
        request_id: str,
        params: BeamSearchParams,
        *args: Any,
        **kwargs: Any,
    ) -> AsyncGenerator[RequestOutput, None]:
        engine = self.engine_client
        enabled = KVReuseConfig.from_vllm_config(engine.vllm_config).engine_beam_search
        if not enabled or prompt.get("type") != "token":
            async for output in original(
                self, prompt, request_id, params, *args, **kwargs
            ):
                yield output
            return
        tokenizer = self.renderer.get_tokenizer()
        sampling = root_sampling_params(params, tokenizer.eos_token_id)
        outputs = [
            output
            async for output in engine.generate(
                prompt, sampling, request_id, *args, **kwargs
            )
        ]
        final = outputs[-1]
        yield beam_output(final, prompt, params, tokenizer)

    return beam_search
