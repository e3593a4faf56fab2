"""Patches on the OpenAI server and the ``LLM`` API: request fields, renderers,
beam search, continuation entry points."""

from __future__ import annotations

from vllm_kvreuse.patches.registry import ABSENT, V0_32_0, Patch

PATCHES: tuple[Patch, ...] = (
    Patch(
        target="vllm.entrypoints.openai.completion.protocol:"
        "CompletionRequest.to_sampling_params",
        wrapper="vllm_kvreuse.frontend:wrap_to_sampling_params",
        kind="function",
        signatures={
            V0_32_0: "(self, max_tokens: int, default_sampling_params: dict | None "
            "= None) -> vllm.sampling_params.SamplingParams"
        },
        why="cache_hit_threshold, retain_kv and retain_kv_ttl are top-level "
        "request fields; the request model keeps unknown fields but passes "
        "none of them on.",
        how="Validates the fields (HTTP 400) and copies them into "
        "SamplingParams.extra_args.",
        remove_when="vLLM forwards plugin request fields (PR #24520, which "
        "added cache_hit_threshold, was closed).",
    ),
    Patch(
        target="vllm.entrypoints.openai.chat_completion.protocol:"
        "ChatCompletionRequest.to_sampling_params",
        wrapper="vllm_kvreuse.frontend:wrap_to_sampling_params",
        kind="function",
        signatures={
            V0_32_0: "(self, max_tokens: int, default_sampling_params: dict) "
            "-> vllm.sampling_params.SamplingParams"
        },
        why="As CompletionRequest.to_sampling_params.",
        how="As CompletionRequest.to_sampling_params.",
        remove_when="As CompletionRequest.to_sampling_params.",
    ),
    Patch(
        target="vllm.entrypoints.openai.completion.serving:"
        "OpenAIServingCompletion.completion_stream_generator",
        wrapper="vllm_kvreuse.admission.streaming:wrap_stream_generator",
        kind="function",
        signatures={V0_32_0: "sha256:319c1f1932ff8c38"},
        why="The stream generator drops an output with no text and no tokens "
        "even when it carries a finish reason, so a stream rejected on "
        "admission would end without finish_reason 'cache_threshold'.",
        how="Watches the engine results for rejections and adds the missing "
        "finishing chunk before the usage chunk or [DONE].",
        remove_when="Upstream emits finish-only chunks for empty outputs.",
    ),
    Patch(
        target="vllm.entrypoints.openai.chat_completion.serving:"
        "OpenAIServingChat.chat_completion_stream_generator",
        wrapper="vllm_kvreuse.admission.streaming:wrap_stream_generator",
        kind="function",
        signatures={V0_32_0: "sha256:da87210e55db4e63"},
        why="As OpenAIServingCompletion.completion_stream_generator.",
        how="As OpenAIServingCompletion.completion_stream_generator.",
        remove_when="As OpenAIServingCompletion.completion_stream_generator.",
    ),
    Patch(
        target="vllm.entrypoints.openai.completion.protocol:CompletionRequest",
        wrapper="vllm_kvreuse.frontend:promptless_completion_request",
        kind="subclass",
        signatures={V0_32_0: "sha256:1eb0754396b7f3d5"},
        why="The request model refuses a body without a prompt, but a "
        "continuation, or a chunked prompt sent as `chunks`, leaves it out.",
        how="A subclass overrides the validator validate_prompt_and_prompt_embeds "
        "to let a body with continuation_of or chunks through, and otherwise "
        "calls the original; a second before-validator refuses a "
        "use_beam_search that is not a JSON boolean. The API server builds its "
        "routes after plugins load, so they see the subclass.",
        remove_when="vLLM gains continuation requests and segmented prompts.",
    ),
    Patch(
        target="vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest",
        wrapper="vllm_kvreuse.frontend:strict_chat_completion_request",
        kind="subclass",
        signatures={V0_32_0: "sha256:12cfed99cdb069e9"},
        why='pydantic reads use_beam_search: "yes" as true, so a malformed body '
        "would start an engine-side beam search.",
        how="A subclass adds a before-validator that refuses a use_beam_search "
        "that is not a JSON boolean (400).",
        remove_when="vLLM's request models use strict booleans.",
    ),
    Patch(
        target="vllm.entrypoints.openai.completion.serving:"
        "OpenAIServingCompletion.render_completion_request",
        wrapper="vllm_kvreuse.frontend:wrap_render_completion_request",
        kind="function",
        signatures={
            V0_32_0: "(self, request: vllm.entrypoints.openai.completion.protocol."
            "CompletionRequest) -> list[vllm.inputs.engine.TokensInput | "
            "vllm.inputs.engine.EmbedsInput | vllm.inputs.engine.MultiModalInput | "
            "vllm.inputs.engine.EncoderDecoderInput] | "
            "vllm.entrypoints.serve.engine.protocol.ErrorResponse"
        },
        why="A body with continuation_of has no prompt of its own (the "
        "parent's tokens plus a suffix), and a chunked prompt must be "
        "tokenised segment by segment.",
        how="For such a body, returns the token-id engine input built from the "
        "parent record or from the segments (or a 404/400 error object); "
        "otherwise calls the original.",
        remove_when="vLLM gains continuation requests and segmented prompts.",
    ),
    Patch(
        target="vllm.entrypoints.openai.chat_completion.serving:"
        "OpenAIServingChat.render_chat_request",
        wrapper="vllm_kvreuse.frontend:wrap_render_chat_request",
        kind="function",
        signatures={
            V0_32_0: "(self, request: vllm.entrypoints.openai.chat_completion.protocol."
            "ChatCompletionRequest) -> tuple[list[vllm.renderers.chat_utils."
            "ConversationMessage], list[vllm.inputs.engine.TokensInput | "
            "vllm.inputs.engine.EmbedsInput | vllm.inputs.engine.MultiModalInput | "
            "vllm.inputs.engine.EncoderDecoderInput]] | "
            "vllm.entrypoints.serve.engine.protocol.ErrorResponse"
        },
        why="As OpenAIServingCompletion.render_completion_request, for chat.",
        how="As OpenAIServingCompletion.render_completion_request; the chat "
        "template is not applied to a continuation. A chunked chat "
        "(chunk_messages, or the separator in the rendering) is rendered by "
        "vLLM's OnlineRenderer.render_chat, cut at messages, documents or "
        "the separator, and refused if the pieces' tokens are not vLLM's.",
        remove_when="As OpenAIServingCompletion.render_completion_request.",
    ),
    Patch(
        target="vllm.entrypoints.llm:LLM.generate_continuation",
        wrapper="vllm_kvreuse.continuation.frontend:make_llm_generate_continuation",
        kind="new",
        signatures={V0_32_0: ABSENT},
        why="The offline API for continuation requests.",
        how="Adds the method; it builds the child from the parent record and "
        "calls LLM.generate.",
        remove_when="vLLM gains continuation requests.",
    ),
    Patch(
        target="vllm.v1.engine.async_llm:AsyncLLM.generate_continuation",
        wrapper="vllm_kvreuse.continuation.frontend:make_async_generate_continuation",
        kind="new",
        signatures={V0_32_0: ABSENT},
        why="The async API for continuation requests, as the issue names it.",
        how="Adds the method; it waits for a running parent, builds the child "
        "and calls AsyncLLM.generate.",
        remove_when="vLLM gains continuation requests.",
    ),
    Patch(
        target="vllm.entrypoints.generate.beam_search.online:"
        "BeamSearchOnlineMixin.beam_search",
        wrapper="vllm_kvreuse.beam.frontend:wrap_beam_search",
        kind="function",
        signatures={V0_32_0: "sha256:c2c239908fcd6434"},
        why="vLLM's beam search runs in the API server and sends one engine "
        "request per beam per step; --engine-beam-search moves the loop into "
        "the engine.",
        how="With the flag on, sends one root request and converts the "
        "engine's beams into the RequestOutput the original loop yields; with "
        "it off, calls the original.",
        remove_when="vLLM runs beam search in the engine.",
    ),
    Patch(
        target="vllm.entrypoints.llm:LLM.beam_search",
        wrapper="vllm_kvreuse.beam.frontend:wrap_llm_beam_search",
        kind="function",
        signatures={
            V0_32_0: "(self, prompts: list[vllm.inputs.llm.TokensPrompt | "
            "vllm.inputs.llm.TextPrompt], params: vllm.sampling_params."
            "BeamSearchParams, lora_request: list[vllm.lora.request.LoRARequest] | "
            "vllm.lora.request.LoRARequest | None = None, use_tqdm: bool = False, "
            "concurrency_limit: int | None = None) -> list[vllm.entrypoints.generate."
            "beam_search.utils.BeamSearchOutput]"
        },
        why="Offline beam search runs the same per-beam-per-step loop as the "
        "server's, in the LLM process.",
        how="With --engine-beam-search (engine_beam_search=True) on, sends one "
        "root request per prompt through LLM.generate and converts the engine's "
        "beams into BeamSearchOutput; otherwise calls the original.",
        remove_when="vLLM runs beam search in the engine.",
    ),
)
