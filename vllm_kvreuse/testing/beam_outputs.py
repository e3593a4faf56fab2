"""A beam search's root output as the engine sends it (tests, benchmarks)."""

from __future__ import annotations

from vllm import CompletionOutput, RequestOutput

from vllm_kvreuse.beam.result import BeamOut, BeamResult, encode


def root_output(prompt: list[int], beams: list[list[int]]) -> RequestOutput:
    """The root's final output carrying ``beams`` (best first; scores -1,
    -2, ...) in its stop reason, as :mod:`vllm_kvreuse.beam.result` encodes
    them."""
    result = BeamResult(
        beams=[BeamOut(tokens, -1.0 - i, "length") for i, tokens in enumerate(beams)]
    )
    out = CompletionOutput(
        index=0, text="", token_ids=[], cumulative_logprob=None, logprobs=None,
        finish_reason="length", stop_reason=encode(result),
    )  # fmt: skip
    return RequestOutput(
        request_id="root", prompt=None, prompt_token_ids=prompt,
        prompt_logprobs=None, outputs=[out], finished=True,
    )  # fmt: skip
