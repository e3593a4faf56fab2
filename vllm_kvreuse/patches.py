"""Every place where vllm-kvreuse replaces an upstream vLLM symbol.

vLLM's extension points (general plugins, ``scheduler_cls``,
``SamplingParams.extra_args``, ``additional_config``) carry most of the
plugin; what they cannot reach is patched here and only here. Each entry
names its target, why it exists, how it works, and what upstream change
would let us delete it.

Rules:
- A patch wraps the original (kept as ``__wrapped__``) and calls it; none
  copies an upstream body.
- :func:`apply_all` is idempotent and runs in every process that loads the
  plugin (API server, engine core, workers).
- ``signatures`` holds the original's signature in each supported vLLM
  release (:data:`vllm_kvreuse.compat.SUPPORTED_VLLM`);
  ``tests/unit/test_patches.py`` checks the installed release's, requires one
  for every supported release, and checks that no module patches vLLM
  outside this table.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

MARKER = "__kvreuse_patch__"

Kind = Literal["function", "staticmethod", "classmethod", "new", "subclass"]
"""How the replacement is installed: "new" adds a method upstream lacks;
"subclass" replaces a module's class by a subclass of it (for pydantic request
models, whose validators only a subclass can override)."""

ABSENT = "absent"
"""The signature of a "new" patch: the attribute must not exist upstream."""

V0_32_0 = "0.32.0"
"""Key of vLLM 0.32.0's signatures (a key of ``compat.SUPPORTED_VLLM``)."""


@dataclass(frozen=True, slots=True)
class Patch:
    """One replaced upstream attribute.

    ``target`` is ``"module:Owner.attr"`` (``"module:attr"`` for a module's
    function); ``wrapper`` is ``"module:function"``, a function that takes
    the original and returns its replacement. ``signatures`` maps a vLLM
    release to :func:`signature_of` the original in that release.
    """

    target: str
    wrapper: str
    kind: Kind
    signatures: dict[str, str]
    why: str
    how: str
    remove_when: str

    def owner_and_attr(self) -> tuple[Any, str]:
        module_name, qualname = self.target.split(":")
        *owner_path, attr = qualname.split(".")
        owner: Any = importlib.import_module(module_name)
        for name in owner_path:
            owner = getattr(owner, name)
        return owner, attr

    def original(self) -> Callable[..., Any] | None:
        """The upstream function, whether or not the patch is applied.

        None for a "new" patch: there is no upstream function.
        """
        owner, attr = self.owner_and_attr()
        current = inspect.getattr_static(owner, attr, None)
        if self.kind == "new" and (current is None or is_patched(current)):
            return None
        if self.kind == "subclass" and is_patched(current):
            return current.__bases__[0]
        if isinstance(current, (staticmethod, classmethod)):
            current = current.__func__
        return (
            getattr(current, "__wrapped__", current) if is_patched(current) else current
        )

    def apply(self) -> bool:
        """Installs the replacement unless it is there already; True if installed."""
        owner, attr = self.owner_and_attr()
        current = inspect.getattr_static(owner, attr, None)
        raw = (
            current.__func__
            if isinstance(current, (staticmethod, classmethod))
            else current
        )
        if is_patched(raw):
            return False
        assert (self.kind == "new") == (raw is None), (
            f"{self.target}: a 'new' patch must add a missing attribute, "
            "any other must wrap an existing one"
        )
        module_name, func_name = self.wrapper.split(":")
        make = getattr(importlib.import_module(module_name), func_name)
        if raw is None or self.kind == "subclass":
            replacement = make(raw)
        else:
            replacement = functools.wraps(raw)(make(raw))
        setattr(replacement, MARKER, self.target)
        if self.kind == "staticmethod":
            replacement = staticmethod(replacement)
        elif self.kind == "classmethod":
            replacement = classmethod(replacement)
        setattr(owner, attr, replacement)
        return True


def is_patched(func: Any) -> bool:
    return getattr(func, MARKER, None) is not None


def signature_of(func: Callable[..., Any] | None) -> str:
    """The signature as text; long ones (dataclass __init__) as a short hash."""
    if func is None:
        return ABSENT
    # A subclassed class is checked by its whole source.
    text = (
        inspect.getsource(func)
        if isinstance(func, type)
        else str(inspect.signature(func))
    )
    # Defaults print as "<... object at 0x...>": drop the address.
    text = re.sub(r" at 0x[0-9a-f]+>", ">", text)
    if len(text) <= 400:
        return text
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


_ARGS = "vllm.engine.arg_utils"

PATCHES: tuple[Patch, ...] = (
    Patch(
        target=f"{_ARGS}:EngineArgs.add_cli_args",
        wrapper="vllm_kvreuse.engine_args:wrap_add_cli_args",
        kind="staticmethod",
        signatures={
            V0_32_0: "(parser: vllm.utils.argparse_utils.FlexibleArgumentParser) "
            "-> vllm.utils.argparse_utils.FlexibleArgumentParser"
        },
        why="`vllm serve --help` must list the plugin's flags; general plugins "
        "have no hook to add CLI arguments.",
        how="Calls the original, then adds a 'vllm-kvreuse' argument group.",
        remove_when="vLLM gains a plugin hook for engine CLI arguments.",
    ),
    Patch(
        target=f"{_ARGS}:EngineArgs.from_cli_args",
        wrapper="vllm_kvreuse.engine_args:wrap_from_cli_args",
        kind="classmethod",
        signatures={V0_32_0: "(cls, args: argparse.Namespace)"},
        why="EngineArgs only copies its own dataclass fields from the parsed "
        "namespace, so the plugin's flags would be dropped.",
        how="Calls the original, then folds the plugin's flags into "
        "additional_config['kvreuse'], which reaches every process.",
        remove_when="Same as add_cli_args.",
    ),
    Patch(
        target=f"{_ARGS}:EngineArgs.__init__",
        wrapper="vllm_kvreuse.engine_args:wrap_engine_args_init",
        kind="function",
        signatures={V0_32_0: "sha256:b04e5258010a7129"},
        why="LLM(...) passes unknown keyword arguments to EngineArgs, a "
        "dataclass that refuses them.",
        how="Pops the plugin's settings from the keyword arguments and folds "
        "them into additional_config before calling the original.",
        remove_when="Same as add_cli_args.",
    ),
    Patch(
        target=f"{_ARGS}:AsyncEngineArgs.__init__",
        wrapper="vllm_kvreuse.engine_args:wrap_engine_args_init",
        kind="function",
        signatures={V0_32_0: "sha256:65d303dd4cfbf265"},
        why="AsyncEngineArgs is a dataclass of its own with its own __init__.",
        how="As EngineArgs.__init__.",
        remove_when="Same as add_cli_args.",
    ),
    Patch(
        target="vllm.config.scheduler:SchedulerConfig.get_scheduler_cls",
        wrapper="vllm_kvreuse.core.layer:wrap_get_scheduler_cls",
        kind="function",
        signatures={V0_32_0: "(self) -> type['SchedulerInterface']"},
        why="Setting scheduler_cls to one class would lose vLLM's choice "
        "between Scheduler and AsyncScheduler (and any user or platform "
        "scheduler).",
        how="Calls the original; when a feature is on, returns a subclass with "
        "the plugin's hook layer in front of whatever class vLLM chose, else "
        "vLLM's class untouched.",
        remove_when="scheduler_cls accepts mixins, or a scheduler plugin hook.",
    ),
    Patch(
        target="vllm.config.vllm:VllmConfig.__post_init__",
        wrapper="vllm_kvreuse.core.layer:wrap_vllm_config_post_init",
        kind="function",
        signature="(self)",
        why="get_scheduler_cls sees only the scheduler config, not "
        "additional_config, yet must know whether a feature is on.",
        how="Calls the original, validates additional_config['kvreuse'] (a "
        "bad setting fails start-up), and records the features switched on "
        "as an attribute of the scheduler config.",
        remove_when="Same as get_scheduler_cls.",
    ),
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
        target="vllm.v1.engine.input_processor:InputProcessor._validate_params",
        wrapper="vllm_kvreuse.frontend:wrap_validate_params",
        kind="function",
        signatures={
            V0_32_0: "(self, params: vllm.sampling_params.SamplingParams | "
            "vllm.pooling_params.PoolingParams, supported_tasks: "
            "tuple[typing.Literal['generate', 'transcription', 'realtime', "
            "'embed', 'classify', 'token_embed', 'token_classify', 'plugin', "
            "'embed&token_classify', 'render'], ...]) -> bool | None"
        },
        why="A bad plugin option in SamplingParams.extra_args must fail in the "
        "caller's process with a clear error, not in the engine.",
        how="Calls the original, then validates the plugin's extra_args keys.",
        remove_when="vLLM validates plugin extra_args (no hook today).",
    ),
    Patch(
        target="vllm.v1.engine.async_llm:AsyncLLM.__init__",
        wrapper="vllm_kvreuse.continuation.frontend:wrap_engine_client_init",
        kind="function",
        signature="sha256:79a4280ae07a9fb6",
        why="Continuation needs one parent registry per engine client, able "
        "to wake the engine core when a retention expires.",
        how="Calls the original; with continuation on, gives the output "
        "processor its registry, bound to the engine-core client.",
        remove_when="vLLM keeps finished requests' tokens addressable by id.",
    ),
    Patch(
        target="vllm.v1.engine.llm_engine:LLMEngine.__init__",
        wrapper="vllm_kvreuse.continuation.frontend:wrap_engine_client_init",
        kind="function",
        signature="sha256:fe9afe55aa7cc7fc",
        why="As AsyncLLM.__init__, for the offline engine (LLM).",
        how="As AsyncLLM.__init__ (no wake-up: expired parents are released at "
        "the next step).",
        remove_when="As AsyncLLM.__init__.",
    ),
    Patch(
        target="vllm.v1.engine.output_processor:OutputProcessor.add_request",
        wrapper="vllm_kvreuse.continuation.frontend:wrap_add_request",
        kind="function",
        signatures={
            V0_32_0: "(self, request: vllm.v1.engine.EngineCoreRequest, "
            "prompt: str | None, parent_req: "
            "vllm.v1.engine.parallel_sampling.ParentRequest | None = None, "
            "request_index: int = 0, queue: "
            "vllm.v1.engine.output_processor.RequestOutputCollector | None = None) "
            "-> None"
        },
        why="A continuation names its parent by id, so the frontend must know "
        "each request's engine id, prompt tokens, cache_salt and LoRA.",
        how="Calls the original, then records the new request in the output "
        "processor's parent registry.",
        remove_when="vLLM keeps finished requests' tokens addressable by id.",
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
        "calls the original. The API server builds its routes after plugins "
        "load, so they see the subclass.",
        remove_when="vLLM gains continuation requests and segmented prompts.",
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
        "template is not applied to a continuation.",
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
        target="vllm.v1.engine.core:EngineCore.kvreuse_release_expired",
        wrapper="vllm_kvreuse.continuation.engine:make_release_expired_utility",
        kind="new",
        signatures={V0_32_0: ABSENT},
        why="An idle engine core blocks on its input queue, so retained KV "
        "would outlive its TTL until the next request.",
        how="Adds an engine-core utility; the frontend calls it (through "
        "call_utility_async) when a retained parent's TTL runs out.",
        remove_when="vLLM schedules timed work in the engine core.",
    ),
    Patch(
        target="vllm.v1.engine.core:EngineCore.kvreuse_chunk_cache",
        wrapper="vllm_kvreuse.chunk_cache.engine:make_chunk_cache_utility",
        kind="new",
        signatures={V0_32_0: ABSENT},
        why="The chunk store's index lives in the scheduler, in the engine "
        "core; the admin endpoint (an endpoint plugin) needs a way to reach it.",
        how="Adds an engine-core utility that the endpoint plugin calls through "
        "call_utility_async: stats, clear, pin, unpin.",
        remove_when="vLLM exposes KV-connector admin calls.",
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
    Patch(
        target="vllm.v1.engine.output_processor:RequestState._new_completion_output",
        wrapper="vllm_kvreuse.frontend:wrap_new_completion_output",
        kind="function",
        signatures={
            V0_32_0: "(self, token_ids: list[int], finish_reason: "
            "vllm.v1.engine.FinishReason | None, stop_reason: int | str | None) "
            "-> vllm.outputs.CompletionOutput"
        },
        why="FinishReason is a closed IntEnum, so the engine cannot send "
        "'cache_threshold' as a finish reason.",
        how="The scheduler finishes a rejected request as ABORT with "
        "stop_reason 'cache_threshold'; this wrapper turns that pair into "
        "finish_reason 'cache_threshold' and counts it in /metrics. It also "
        "records a finished request's delivered tokens for continuations.",
        remove_when="FinishReason gains a cache-threshold member.",
    ),
    # The helper is defined in worker.utils and imported by name into both
    # model runners, so each binding is wrapped (the V1 runner's is the one
    # vllm-ascend's NPUModelRunner reaches through super()._update_states).
    *(
        Patch(
            target=f"{module}:copy_kv_cache_blocks_inplace",
            wrapper="vllm_kvreuse.device.block_copy:wrap_copy_kv_cache_blocks",
            kind="function",
            signatures={
                V0_32_0: "(kv_caches: collections.abc.Iterable[torch.Tensor], "
                "num_blocks: int, kv_cache_block_copies: collections.abc.Sequence["
                "vllm.v1.core.kv_cache_utils.KVCacheBlockCopy]) -> None"
            },
            why="Copy-on-write tails (continuation, beam forks, partial prefix "
            "hits) reach the workers as SchedulerOutput.kv_cache_block_copies, "
            "applied by this helper, which reads cache.device on each layer's "
            "entry: vllm-ascend keeps a layer's KV as a (k, v) tuple, so it "
            "raises AttributeError there.",
            how="Passes each layer's tensors (a tuple's members, a tensor as "
            "itself) to the original, which copies block rows of each one; "
            "plain tensors reach it unchanged.",
            remove_when="vLLM's helper accepts per-layer tuples of tensors.",
        )
        for module in (
            "vllm.v1.worker.utils",
            "vllm.v1.worker.gpu_model_runner",
            "vllm.v1.worker.gpu.model_runner",
        )
    ),
)


SCHEDULER_OVERRIDES: dict[str, str] = {
    "__init__": "sha256:f3bbb3041173f9db",
    "add_request": "(self, request: vllm.v1.request.Request) -> None",
    "finish_requests": "(self, request_ids: str | collections.abc.Iterable[str] | "
    "None, finished_status: vllm.v1.request.RequestStatus) -> "
    "list[vllm.v1.request.Request]",
    "_free_request": "(self, request: vllm.v1.request.Request, delay_free_blocks: "
    "bool = False) -> tuple[dict[str, typing.Any] | None, dict[str, typing.Any] "
    "| None]",
    "_free_blocks": "(self, request: vllm.v1.request.Request)",
    "_preempt_request": "(self, request: vllm.v1.request.Request, timestamp: "
    "float, drop_stale_output: bool = False) -> None",
    "_get_local_prefix_cache_hit": "(self, request: vllm.v1.request.Request) -> "
    "tuple[vllm.v1.core.kv_cache_manager.KVCacheBlocks, int, int, bool]",
    "schedule": "(self, throttle_prefills: bool = False) -> "
    "vllm.v1.core.sched.output.SchedulerOutput",
    "update_from_output": "(self, scheduler_output: vllm.v1.core.sched.output."
    "SchedulerOutput, model_runner_output: vllm.v1.outputs.ModelRunnerOutput) -> "
    "dict[int, vllm.v1.engine.EngineCoreOutputs]",
    "has_requests": "(self) -> bool",
    "reset_prefix_cache": "(self, reset_running_requests: bool = False, "
    "reset_connector: bool = False) -> bool",
}
"""Upstream ``Scheduler`` methods the hook layer
(:class:`vllm_kvreuse.core.layer.KVReuseLayer`) overrides, each once, with
their signatures on vLLM 0.32.0. Not patches (the layer is a subclass that
calls ``super()``), but as tied to upstream: several are private, and
``tests/unit/test_hook_layer.py`` fails when one changes."""


def apply_all() -> list[str]:
    """Applies every patch not yet applied in this process; returns their targets."""
    return [patch.target for patch in PATCHES if patch.apply()]
