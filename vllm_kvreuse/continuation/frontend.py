"""Frontend side of continuation requests: engine clients, parents, children.

- Each engine client (``AsyncLLM``, ``LLMEngine``) gets its parent registry
  when it is built, if continuation is on (:func:`wrap_engine_client_init`).
- Parents are recorded as the output processor adds them, and completed with
  the tokens actually delivered when their final output is made.
- A child (HTTP ``continuation_of``, :mod:`.serving`; or
  ``generate_continuation``, the Python API here) is turned into an
  ordinary token-id request: parent prompt + delivered output + suffix,
  with the internal key ``kvreuse_parent`` naming the parent's engine
  request so that the scheduler can hand over its blocks. An unknown,
  expired or other-tenant parent raises ``ParentNotFound``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.inputs.engine import tokens_input
from vllm.sampling_params import SamplingParams

from vllm_kvreuse.continuation import params
from vllm_kvreuse.continuation.engine import RELEASE_EXPIRED
from vllm_kvreuse.continuation.metrics import count_continuation
from vllm_kvreuse.continuation.registry import (
    ParentRecord,
    ParentRegistry,
    record_of,
    registry_of,
    track,
)
from vllm_kvreuse.core.request_keys import PARENT, carried, seal
from vllm_kvreuse.core.spec import inherited_keys, settings_of

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
