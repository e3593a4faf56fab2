"""Frontend side of continuation requests.

- Each engine client (``AsyncLLM``, ``LLMEngine``) gets its parent registry
  when it is built, if continuation is on (:func:`wrap_engine_client_init`).
- Parents are recorded as the output processor adds them, and completed with
  the tokens actually delivered when their final output is made.
- A child (HTTP ``continuation_of``, or ``generate_continuation``) is turned
  into an ordinary token-id request: parent prompt + delivered output +
  suffix, with the internal key ``kvreuse_parent`` naming the parent's engine
  request so that the scheduler can hand over its blocks.
Errors: unknown, expired, aborted or other-tenant parents are 404
(``ParentNotFound``); malformed fields and LoRA mismatches are 400.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.inputs.engine import tokens_input
from vllm.sampling_params import SamplingParams

from vllm_kvreuse.continuation import params, remote
from vllm_kvreuse.continuation.engine import RELEASE_EXPIRED
from vllm_kvreuse.continuation.metrics import count_continuation
from vllm_kvreuse.continuation.params import CONTINUATION_OF
from vllm_kvreuse.continuation.registry import (
    ParentNotFound,
    ParentRecord,
    ParentRegistry,
    record_of,
    registry_of,
    track,
)
from vllm_kvreuse.core.request_keys import PARENT, carried, seal
from vllm_kvreuse.core.spec import inherited_keys, settings_of
from vllm_kvreuse.core.upstream.frontend import lora_request_of

CHOICE = "continuation_choice"
SUFFIX = "continuation_suffix"
SUFFIX_TOKEN_IDS = "continuation_suffix_token_ids"

# -- the registry of each engine client ------------------------------------------


def wrap_engine_client_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """``AsyncLLM.__init__`` / ``LLMEngine.__init__``: gives the engine
    client's output processor its parent registry, if continuation is on.

    An async client can wake its engine core when a retention expires; an
    offline one releases expired parents at its next step.
    """

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        config = settings_of(self.vllm_config)
        if not config.enable_continuation:
            return
        engine_core = self.engine_core
        release = getattr(engine_core, "call_utility_async", None)
        registry = ParentRegistry(
            release_expired=(lambda: release(RELEASE_EXPIRED)) if release else None,
            default_ttl=config.retain_kv_ttl,
            inherited_keys=inherited_keys(config.features),
        )
        self.output_processor.kvreuse_parents = registry
        # The DP load balancer records ranks in it and routes children by it.
        engine_core.kvreuse_parents = registry

    return __init__


# -- recording parents ---------------------------------------------------------


def wrap_add_request(original: Callable[..., Any]) -> Callable[..., Any]:
    """``OutputProcessor.add_request``: records each generation request."""

    def add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> None:
        original(self, request, *args, **kwargs)
        registry = registry_of(self)
        if registry is None:
            return
        state = self.request_states.get(request.request_id)
        sampling = request.sampling_params
        if state is None or sampling is None or state.detokenizer is None:
            return
        extra = sampling.extra_args or {}
        record = ParentRecord(
            external_id=state.external_req_id,
            choice=state.request_index,
            engine_request_id=request.request_id,
            prompt_token_ids=state.prompt_token_ids or [],
            cache_salt=request.cache_salt,
            lora_name=state.lora_name,
            retain_kv=params.wants_retention(extra),
            ttl=params.own_ttl(extra),
            is_continuation=PARENT in extra,
            inherited=carried(extra, registry.inherited_keys),
        )
        track(registry, state, record)

    return add_request


def on_final_output(request_state: Any, output: Any, *_: Any) -> None:
    """Completes the request's record with what the client received (the
    spec's ``on_final_output``; it reads the finish reason from ``output``,
    as the client will see it)."""
    tracked = record_of(request_state)
    if tracked is None or request_state.detokenizer is None:
        return
    registry, record = tracked
    registry.finished(
        record, request_state.detokenizer.output_token_ids, output.finish_reason
    )
    if record.retain_kv and output.finish_reason in ("stop", "length"):
        registry.release_when_expired(record)
    if record.is_continuation:
        count_continuation("completed", request_state.num_cached_tokens)


# -- building children -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Child:
    """A resolved continuation: its prompt and what its engine request carries."""

    prompt_token_ids: list[int]
    parent_engine_request_id: str
    inherited: dict[str, Any] = field(default_factory=dict)
    """The parent's keys a child carries, as the owners' specs mark them."""

    @property
    def extra_args(self) -> dict[str, Any]:
        """Names the parent, and carries what its owners marked inherited
        (a chunked parent's chunks, so the child is hashed like the parent
        and inherits its blocks)."""
        return seal({PARENT: self.parent_engine_request_id, **self.inherited})


def build_child(record: ParentRecord, suffix_token_ids: Sequence[int]) -> Child:
    return Child(
        record.token_ids + list(suffix_token_ids),
        record.engine_request_id,
        record.inherited,
    )


def with_parent(sampling_params: SamplingParams | None, child: Child) -> SamplingParams:
    """A copy of ``sampling_params`` that names ``child``'s parent."""
    params_ = (sampling_params or SamplingParams()).clone()
    params_.extra_args = {**(params_.extra_args or {}), **child.extra_args}
    return params_


# -- HTTP --------------------------------------------------------------------


class BadContinuation(ValueError):
    """A malformed continuation request (HTTP 400)."""


def _suffix_token_ids(body: Mapping[str, Any], tokenizer: Any) -> list[int]:
    text, ids = body.get(SUFFIX), body.get(SUFFIX_TOKEN_IDS)
    if text is not None and ids is not None:
        raise BadContinuation(f"give {SUFFIX} or {SUFFIX_TOKEN_IDS}, not both")
    if ids is not None:
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
        ):
            raise BadContinuation(f"{SUFFIX_TOKEN_IDS} must be a list of token ids")
        return ids
    if text is None:
        return []
    if not isinstance(text, str):
        raise BadContinuation(f"{SUFFIX} must be a string")
    return tokenizer.encode(text, add_special_tokens=False)


def _choice(body: Mapping[str, Any]) -> int:
    choice = body.get(CHOICE, 0)
    if not isinstance(choice, int) or isinstance(choice, bool) or choice < 0:
        raise BadContinuation(f"{CHOICE} must be a non-negative integer")
    return choice


async def resolve_http(
    serving: Any, request: Any, prompt_given: bool
) -> list[Any] | None:
    """Turns a continuation body into engine inputs; None if it is not one.

    Raises ``BadContinuation`` (400), ``ParentNotFound`` (404) or
    ``VLLMValidationError`` (400, LoRA mismatch). On success it also names
    the parent in ``request.vllm_xargs``, which upstream copies into
    ``SamplingParams.extra_args``.
    """
    body = request.model_extra or {}
    parent_id = body.get(CONTINUATION_OF)
    if parent_id is None:
        return None
    if not isinstance(parent_id, str) or not parent_id:
        raise BadContinuation(f"{CONTINUATION_OF} must be a response id string")
    if prompt_given:
        raise BadContinuation(
            f"a request with {CONTINUATION_OF} takes its prompt from the parent; "
            "leave prompt/messages empty and pass the suffix as "
            f"{SUFFIX} or {SUFFIX_TOKEN_IDS}"
        )
    suffix = _suffix_token_ids(body, serving.renderer.tokenizer)
    engine = serving.engine_client
    registry = registry_of(engine.output_processor)
    if registry is None:
        raise BadContinuation(
            f"{CONTINUATION_OF} needs a server started with --enable-continuation"
        )
    config = settings_of(engine.vllm_config)
    choice = _choice(body)
    try:
        record = registry.find_response(
            parent_id, choice, request.cache_salt, config.retain_kv_ttl
        )
    except ParentNotFound:
        if not remote.is_multi_process(engine.vllm_config):
            raise
        record = await remote.find_remote(
            engine, registry, parent_id, choice, request.cache_salt,
            config.continuation_wait_timeout,
        )  # fmt: skip
    await registry.wait(record, config.continuation_wait_timeout)
    lora = lora_request_of(serving, request)
    if (lora.lora_name if lora else None) != record.lora_name:
        raise VLLMValidationError(
            "the continuation must use the same LoRA adapter (model) as its "
            f"parent ({record.lora_name or 'the base model'})",
            parameter="model",
        )
    child = build_child(record, suffix)
    request.vllm_xargs = {**(request.vllm_xargs or {}), **child.extra_args}
    count_continuation("resolved", 0)
    return [tokens_input(child.prompt_token_ids, cache_salt=request.cache_salt)]


def error_response(serving: Any, error: Exception) -> Any:
    """The OpenAI error object for a failed continuation."""
    if isinstance(error, ParentNotFound):
        count_continuation("not_found", 0)
        return serving.create_error_response(
            f"no retained or recent request with id {error.args[0]!r} "
            "(unknown, expired, aborted, ended on a stop string in another "
            "API-server process, or not visible to this cache_salt)",
            err_type="NotFoundError",
            status_code=HTTPStatus.NOT_FOUND,
            param=CONTINUATION_OF,
        )
    return serving.create_error_response(str(error), param=CONTINUATION_OF)


async def render_continuation(
    serving: Any, request: Any, prompt_given: bool
) -> list[Any] | Any | None:
    """Engine inputs (or an error object) for a continuation; None otherwise."""
    try:
        inputs = await resolve_http(serving, request, prompt_given)
    except (BadContinuation, ParentNotFound, VLLMValidationError) as e:
        return error_response(serving, e)
    return inputs


async def render_completion(serving: Any, request: Any) -> list[Any] | Any | None:
    """The spec's ``render_completion``: a continuation leaves ``prompt`` empty."""
    given = request.prompt not in (None, "", [])
    return await render_continuation(serving, request, given)


async def render_chat(serving: Any, request: Any) -> list[Any] | Any | None:
    """The spec's ``render_chat``: a continuation sends no messages."""
    return await render_continuation(serving, request, bool(request.messages))


# -- Python API ----------------------------------------------------------------


def engine_registry(engine: Any) -> ParentRegistry:
    """The engine client's registry; ``ValueError`` if continuation is off."""
    registry = registry_of(engine.output_processor)
    if registry is None:
        raise ValueError(
            "continuation requests need the engine started with "
            "enable_continuation=True (--enable-continuation)"
        )
    return registry


def make_llm_generate_continuation(_: None) -> Callable[..., Any]:
    def generate_continuation(
        self: Any,
        parent_request_id: str,
        suffix_token_ids: Sequence[int] = (),
        sampling_params: SamplingParams | None = None,
        *,
        choice: int = 0,
        cache_salt: str | None = None,
        use_tqdm: bool = False,
    ) -> Any:
        """Continues a finished request of this ``LLM`` by its ``request_id``.

        The child's prompt is the parent's prompt token ids, its output token
        ids as returned, then ``suffix_token_ids``; a parent that asked for
        ``retain_kv`` hands its KV blocks over, so only the suffix and the
        parent's last token are prefilled. Raises ``ParentNotFound`` for an
        unknown, expired or other-salt parent.
        """
        engine = self.llm_engine
        registry = engine_registry(engine)
        record = registry.find(
            parent_request_id, choice, cache_salt, registry.default_ttl
        )
        child = build_child(record, suffix_token_ids)
        prompt = tokens_input(child.prompt_token_ids, cache_salt=cache_salt)
        (output,) = self.generate(
            [prompt], with_parent(sampling_params, child), use_tqdm=use_tqdm
        )
        return output

    return generate_continuation


def make_async_generate_continuation(_: None) -> Callable[..., Any]:
    async def generate_continuation(
        self: Any,
        parent_request_id: str,
        request_id: str,
        sampling_params: SamplingParams | None = None,
        suffix_token_ids: Sequence[int] = (),
        *,
        choice: int = 0,
        cache_salt: str | None = None,
        **kwargs: Any,
    ) -> AsyncGenerator[Any, None]:
        """``AsyncLLM.generate`` for a continuation of ``parent_request_id``.

        Waits (up to ``--continuation-wait-timeout``) for a parent that is
        still running. Other keyword arguments go to ``generate``.
        """
        config = settings_of(self.vllm_config)
        registry = engine_registry(self)
        record = registry.find(
            parent_request_id, choice, cache_salt, config.retain_kv_ttl
        )
        await registry.wait(record, config.continuation_wait_timeout)
        child = build_child(record, suffix_token_ids)
        prompt = tokens_input(child.prompt_token_ids, cache_salt=cache_salt)
        async for output in self.generate(
            prompt, with_parent(sampling_params, child), request_id, **kwargs
        ):
            yield output

    return generate_continuation
