"""Continuation requests over HTTP: ``continuation_of`` and its fields.

A completion or chat body naming a parent (``continuation_of``, with
``continuation_suffix`` or ``continuation_suffix_token_ids`` and
``continuation_choice``) is rendered here (the spec's ``render_completion``
and ``render_chat``) into a token prompt built from the parent
(:func:`~vllm_kvreuse.continuation.frontend.build_child`), its engine id in
``vllm_xargs`` as the sealed internal key ``kvreuse_parent``. Errors:
unknown, expired, aborted or other-tenant parents are 404
(``ParentNotFound``); malformed fields and LoRA mismatches are 400.
"""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.inputs.engine import tokens_input

from vllm_kvreuse.continuation import remote
from vllm_kvreuse.continuation.frontend import build_child
from vllm_kvreuse.continuation.metrics import count_continuation
from vllm_kvreuse.continuation.params import CONTINUATION_OF
from vllm_kvreuse.continuation.registry import ParentNotFound, registry_of
from vllm_kvreuse.core.spec import settings_of
from vllm_kvreuse.core.upstream.frontend import lora_request_of

CHOICE = "continuation_choice"
SUFFIX = "continuation_suffix"
SUFFIX_TOKEN_IDS = "continuation_suffix_token_ids"


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
