"""The engine's beams as vLLM's beam-search outputs.

The root request's final output carries its group's best beams in its stop
reason (:mod:`.result`); here they become what vLLM's own front-end loop
would have returned: one ``RequestOutput`` per search online, a
``BeamSearchOutput`` per prompt offline. A search the engine turned back
(threshold, abort, error) passes the engine's answer on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase
from vllm import CompletionOutput, RequestOutput
from vllm.entrypoints.generate.beam_search.utils import (
    BeamSearchOutput,
    BeamSearchSequence,
)
from vllm.sampling_params import BeamSearchParams

from vllm_kvreuse.beam.metrics import count_beam_group
from vllm_kvreuse.beam.result import BeamOut, decode


def take_beams(final: RequestOutput) -> list[BeamOut] | None:
    """The engine's best beams from the root's final output (its stop
    reason, :mod:`.result`), counted in /metrics; None when the engine
    turned the search back (threshold, abort, error)."""
    outputs = final.outputs
    result = decode(outputs[0].stop_reason) if outputs else None
    if result is None:
        return None
    count_beam_group(
        result.forks,
        result.copied_blocks,
        result.member_computed_tokens,
        result.steps_as_one,
    )
    return result.beams


def beam_output(
    final: RequestOutput, prompt: Any, params: BeamSearchParams, tokenizer: Any
) -> RequestOutput:
    """The front-end loop's ``RequestOutput`` from the engine's beams."""
    beams = take_beams(final)
    if beams is None:  # rejected or aborted: pass the engine's answer on
        return final
    eos = tokenizer.eos_token_id
    outputs = []
    for index, beam in enumerate(beams):
        token_ids = beam.token_ids
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
                cumulative_logprob=beam.cum_logprob,
                logprobs=None,
                finish_reason=beam.finish_reason,
                stop_reason=beam.stop_reason,
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


def offline_beam_output(
    final: RequestOutput, prompt: Any, params: BeamSearchParams, tokenizer: Any
) -> BeamSearchOutput:
    """``LLM.beam_search``'s output for one prompt from the engine's beams.

    Sequences hold prompt + generated tokens, as upstream's; per-token
    log-probs are not returned (``logprobs`` is empty). A request the engine
    turned back (cache threshold, abort) gives one sequence: the prompt, with
    the engine's finish reason.
    """
    prompt_ids = list(final.prompt_token_ids or [])
    beams = take_beams(final)
    if beams is None:
        engine_out = final.outputs[0]
        return BeamSearchOutput(
            sequences=[
                BeamSearchSequence(
                    orig_prompt=prompt,
                    tokens=prompt_ids,
                    logprobs=[],
                    finish_reason=engine_out.finish_reason,
                    stop_reason=engine_out.stop_reason,
                )
            ]
        )
    sequences = []
    text_of = _full_text(tokenizer, prompt_ids, params.skip_special_tokens)
    for beam in beams:
        sequences.append(
            BeamSearchSequence(
                orig_prompt=prompt,
                tokens=prompt_ids + beam.token_ids,
                logprobs=[],
                cum_logprob=beam.cum_logprob,
                text=text_of(beam.token_ids),
                finish_reason=beam.finish_reason,
                stop_reason=beam.stop_reason,
            )
        )
    return BeamSearchOutput(sequences=sequences)


def _full_text(
    tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool
) -> Callable[[list[int]], str]:
    """Decodes prompt + a beam's tokens, as vLLM's loop decodes each final
    beam. A transformers tokenizer checks a list's items one by one in
    Python before it decodes (``to_py_obj``: about 40% of the decode of a
    256-token prompt, hundreds of beams per search); an integer array
    (the prompt's, built once, and the beam's tokens) is converted in one
    call to the same list, so the text is the same. Other tokenizers get
    the list."""
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        return lambda tail: tokenizer.decode(
            prompt_ids + tail, skip_special_tokens=skip_special_tokens
        )
    prompt = np.asarray(prompt_ids, dtype=np.int64)
    return lambda tail: tokenizer.decode(
        np.concatenate((prompt, np.asarray(tail, dtype=np.int64))),
        skip_special_tokens=skip_special_tokens,
    )
