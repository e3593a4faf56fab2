"""Frontend side of engine-side beam search (``--engine-beam-search``).

Replaces vLLM's front-end beam-search loop (one engine request per beam per
step, re-sent from the API server) by a single root request; the engine runs
the steps (:mod:`vllm_kvreuse.beam.scheduler.feature`) and returns the best beams in
the root's final output, which is turned into the same ``RequestOutput``
the front-end loop yields. Off by default; with the flag off the original
loop runs unchanged.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

from vllm import RequestOutput
from vllm.config import CacheConfig
from vllm.entrypoints.generate.beam_search.utils import (
    BeamSearchOutput,
)
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TokensPrompt
from vllm.renderers.inputs.preprocess import parse_model_prompt
from vllm.sampling_params import BeamSearchParams, SamplingParams
from vllm.utils.math_utils import cdiv

from vllm_kvreuse.beam.answers import beam_output, offline_beam_output
from vllm_kvreuse.beam.catalog.load import engine_catalog
from vllm_kvreuse.beam.rule import BeamConfig
from vllm_kvreuse.core.request_keys import BEAM, PARENT, seal
from vllm_kvreuse.core.spec import settings_of


def check_fits(prompt_len: int, params: BeamSearchParams, vllm_config: Any) -> None:
    """Refuses a beam search the engine cannot run (``VLLMValidationError``,
    a 400 over HTTP): every beam of a step runs in one batch, so the width
    must fit the running seats (``--max-num-seqs``) and a step's tokens
    (``--max-num-batched-tokens``), and the KV pool (:func:`check_fits_pool`)."""
    width = params.beam_width
    scheduler = vllm_config.scheduler_config
    for limit, flag, what in (
        (scheduler.max_num_seqs, "--max-num-seqs", "running requests"),
        (scheduler.max_num_batched_tokens, "--max-num-batched-tokens", "tokens a step"),
    ):
        if width > limit:
            raise VLLMValidationError(
                f"beam search with width {width} runs {width} beams in every "
                f"step; this engine runs at most {limit} {what} ({flag})",
                parameter="n",
                value=width,
            )
    check_fits_pool(prompt_len, params, vllm_config.cache_config)


def check_fits_pool(
    prompt_len: int, params: BeamSearchParams, cache_config: CacheConfig
) -> None:
    """Refuses a beam search that cannot fit the KV pool.

    Its beams share the prompt's full blocks; each of the ``width`` members
    owns its blocks past them, up to its last token (a member that takes
    another beam gets that beam's KV copied into its own blocks).
    """
    num_blocks = cache_config.num_gpu_blocks
    if not num_blocks:
        return
    usable = num_blocks - 1  # vLLM's block pool keeps one null block
    size = cache_config.block_size
    shared = prompt_len // size
    private = cdiv(prompt_len + params.max_tokens, size) - shared
    needed = shared + params.beam_width * private
    if needed > usable:
        raise VLLMValidationError(
            f"beam search with width {params.beam_width} on a {prompt_len}-token "
            f"prompt needs at least {needed} KV blocks; the KV cache has {usable}",
            parameter="n",
            value=params.beam_width,
        )


CATALOG_ATTR = "kvreuse_sid_catalog"
"""Attribute of a ``BeamSearchParams`` asking for catalog-constrained beams
(set from the HTTP body's ``sid_catalog``, or by :func:`catalog_beam_params`,
through :func:`mark_catalog_params`)."""


def catalog_beam_params(**kwargs: Any) -> BeamSearchParams:
    """``BeamSearchParams(**kwargs)`` whose beams stay in the server's SID
    catalog (``--sid-catalog``), for offline ``LLM.beam_search``."""
    return mark_catalog_params(BeamSearchParams(**kwargs))


def mark_catalog_params(params: BeamSearchParams) -> BeamSearchParams:
    # BeamSearchParams is a msgspec struct with a __dict__: it takes the mark.
    params.kvreuse_sid_catalog = True  # type: ignore[attr-defined]
    return params


PARENT_ATTR = PARENT
"""Attribute of a ``BeamSearchParams`` naming the engine request a
continuation's beam search continues: the root inherits its blocks by name,
and is routed to its DP rank."""


def mark_parent_params(params: BeamSearchParams, parent: str) -> BeamSearchParams:
    params.kvreuse_parent = parent  # type: ignore[attr-defined]
    return params


def wants_catalog(params: BeamSearchParams) -> bool:
    return bool(getattr(params, CATALOG_ATTR, False))


def check_catalog(params: BeamSearchParams, vllm_config: Any) -> None:
    """Refuses catalog beams the server cannot run (400)."""
    if not wants_catalog(params):
        return
    catalog = engine_catalog(vllm_config, "cpu")
    if catalog is None:
        raise VLLMValidationError(
            "sid_catalog needs a server started with --sid-catalog",
            parameter="sid_catalog",
        )
    if params.max_tokens < catalog.depth:
        raise VLLMValidationError(
            f"catalog items are {catalog.depth} tokens long; max_tokens "
            f"{params.max_tokens} would return partial items",
            parameter="max_tokens",
            value=params.max_tokens,
        )


def refuse_catalog_here(params: BeamSearchParams) -> None:
    """vLLM's own beam search knows no catalog: refuse rather than ignore it."""
    if wants_catalog(params):
        raise VLLMValidationError(
            "sid_catalog needs engine-side beam search (--engine-beam-search) "
            "on a token prompt",
            parameter="sid_catalog",
        )


def root_sampling_params(
    params: BeamSearchParams, eos_token_id: int | None, *, keep_eos: bool = False
) -> SamplingParams:
    """The root request's params: one step of the front end's own per-beam params.

    ``keep_eos``: a beam ended by EOS keeps the EOS token (offline
    ``LLM.beam_search`` does; the OpenAI server follows
    ``include_stop_str_in_output``). The root asks for no log-probs: its
    step runs next to the logits (:mod:`vllm_kvreuse.beam.worker.job`). Catalog
    beams are scored at temperature 0: their log-probs are the model's,
    whatever the sampler.
    """
    catalog = wants_catalog(params)
    config = BeamConfig(
        width=params.beam_width,
        max_tokens=params.max_tokens,
        eos_token_id=eos_token_id,
        length_penalty=params.length_penalty,
        ignore_eos=params.ignore_eos,
        include_stop_str_in_output=keep_eos or params.include_stop_str_in_output,
        sid_catalog=catalog,
    )
    internal: dict[str, Any] = {BEAM: config.to_dict()}
    if (parent := getattr(params, PARENT_ATTR, None)) is not None:
        internal[PARENT] = parent
    return SamplingParams(
        max_tokens=1,
        temperature=0.0 if catalog else params.temperature,
        watermarking=False,
        detokenize=False,
        extra_args=seal(internal),
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
        enabled = settings_of(engine.vllm_config).engine_beam_search
        if not enabled or prompt.get("type") != "token":
            refuse_catalog_here(params)
            async for output in original(
                self, prompt, request_id, params, *args, **kwargs
            ):
                yield output
            return
        check_fits(len(prompt["prompt_token_ids"]), params, engine.vllm_config)
        check_catalog(params, engine.vllm_config)
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


def _tokens_prompt(engine_input: Any) -> TokensPrompt:
    prompt = TokensPrompt(prompt_token_ids=engine_input["prompt_token_ids"])
    if salt := engine_input.get("cache_salt"):
        prompt["cache_salt"] = salt
    return prompt


def engine_inputs(llm: Any, prompts: list[Any]) -> list[Any]:
    """``prompts`` rendered as vLLM's own ``LLM.beam_search`` renders them:
    its renderer's completion path, with default tokenisation."""
    model_config = llm.model_config
    parsed = [parse_model_prompt(model_config, prompt) for prompt in prompts]
    return llm.renderer.render_cmpl(parsed)


def wrap_llm_beam_search(original: Callable[..., Any]) -> Callable[..., Any]:
    def beam_search(
        self: Any,
        prompts: list[Any],
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        vllm_config = self.llm_engine.vllm_config
        inputs = engine_inputs(self, prompts)
        if not settings_of(vllm_config).engine_beam_search or any(
            engine_input["type"] != "token" for engine_input in inputs
        ):
            refuse_catalog_here(params)
            return original(
                self, prompts, params, lora_request, use_tqdm, concurrency_limit
            )
        check_catalog(params, vllm_config)
        for engine_input in inputs:
            check_fits(len(engine_input["prompt_token_ids"]), params, vllm_config)
        tokenizer = self.renderer.get_tokenizer()
        sampling = root_sampling_params(params, tokenizer.eos_token_id, keep_eos=True)
        token_prompts = [_tokens_prompt(engine_input) for engine_input in inputs]
        batch = concurrency_limit or len(token_prompts) or 1
        results: list[BeamSearchOutput] = []
        for start in range(0, len(token_prompts), batch):
            finals = self.generate(
                token_prompts[start : start + batch],
                sampling,
                lora_request=lora_request[start : start + batch]
                if isinstance(lora_request, list)
                else lora_request,
                use_tqdm=use_tqdm,
            )
            results += [
                offline_beam_output(final, engine_input, params, tokenizer)
                for final, engine_input in zip(
                    finals, inputs[start : start + batch], strict=True
                )
            ]
        return results

    return beam_search
