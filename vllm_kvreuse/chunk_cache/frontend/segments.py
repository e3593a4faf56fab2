"""Frontend side of the chunk cache: prompts split into segments.

A request chooses chunking explicitly: its ``chunks`` field lists the
segments (system prompt, documents, then the question), each a text or a
list of token ids, instead of ``prompt``. Each text segment is tokenised
alone, so a document's tokens never depend on its neighbours. The engine
gets the concatenated token ids plus the chunk lengths
(``extra_args["kvreuse_chunks"]``).

A ``prompt`` is never split unless the server was started with
``--chunk-separator SEP``: then a text prompt containing ``SEP`` is split
at it (the seed's ``sys##doc1##doc2##question`` format, with ``SEP`` =
``##``) and the separators are not model input. Without the flag every
``prompt`` is left to vLLM untouched, whatever text it contains: ordinary
prompts (markdown headings included) are answered exactly as plain vLLM
answers them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.inputs import tokens_input

from vllm_kvreuse.chunk_cache.params import BODY_FIELD, validate_lengths
from vllm_kvreuse.core.request_keys import CHUNKS, DOCUMENTS, seal
from vllm_kvreuse.core.spec import settings_of


def split_text(text: str, separator: str, tokenizer: Any) -> list[list[int]]:
    """Token ids of each segment of ``text`` split at ``separator``."""
    segments = text.split(separator)
    if any(not segment for segment in segments):
        raise VLLMValidationError(
            f"empty segment in a chunked prompt (separator {separator!r})",
            parameter="prompt",
        )
    return tokenize_segments(segments, tokenizer)


def tokenize_segments(
    segments: Sequence[str | list[int]], tokenizer: Any
) -> list[list[int]]:
    """Each text segment tokenised alone; token-id segments as they are.

    A text first segment gets the tokenizer's special prefix tokens (BOS),
    as the whole prompt would; later ones none.
    """
    return [
        tokenizer.encode(segment, add_special_tokens=number == 0)
        if isinstance(segment, str)
        else segment
        for number, segment in enumerate(segments)
    ]


def _is_segment(segment: Any) -> bool:
    if isinstance(segment, str):
        return bool(segment)
    return (
        isinstance(segment, list)
        and bool(segment)
        and all(type(token) is int and token >= 0 for token in segment)
    )


def check_segments(segments: Any) -> list[str | list[int]]:
    """``chunks`` as texts or token-id lists: at least one chunk and a question."""
    if (
        not isinstance(segments, list)
        or len(segments) < 2
        or not all(_is_segment(segment) for segment in segments)
    ):
        raise VLLMValidationError(
            f"{BODY_FIELD} must be a list of at least two segments, each a "
            "non-empty text or a non-empty list of token ids: the chunks, then "
            "the question",
            parameter=BODY_FIELD,
        )
    return segments


def chunked_prompt(segments: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """(prompt token ids, chunk lengths) of segments whose last is the question."""
    token_ids = [token for segment in segments for token in segment]
    lengths = [len(segment) for segment in segments[:-1]]
    return token_ids, validate_lengths(lengths, len(token_ids))


def chunked_request(
    segments: Sequence[Sequence[int]],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The offline form of a chunked prompt: ``(prompt, extra_args)``.

    ``segments`` are token-id lists: the chunks, then the question. Pass the
    prompt to ``LLM.generate`` and the ``extra_args`` in its
    ``SamplingParams`` (merged with any of your own)::

        prompt, extra_args = chunked_request([system, doc_a, doc_b, question])
        llm.generate(prompt, SamplingParams(max_tokens=32, extra_args=extra_args))
    """
    token_ids, lengths = chunked_prompt(segments)
    return {"prompt_token_ids": token_ids}, seal({CHUNKS: lengths})


def segments_of(request: Any, separator: str, tokenizer: Any) -> list[list[int]] | None:
    """The segments of an HTTP completion request, or None if it is not chunked.

    A request is chunked if it sends ``chunks``, or if ``separator`` (the
    server's ``--chunk-separator``; empty: off) occurs in its text prompt.
    """
    body = request.model_extra or {}
    if body.get(BODY_FIELD) is not None:
        if request.prompt not in (None, "", []):
            raise VLLMValidationError(
                f"send either prompt or {BODY_FIELD}, not both", parameter=BODY_FIELD
            )
        return tokenize_segments(check_segments(body[BODY_FIELD]), tokenizer)
    if separator and isinstance(request.prompt, str) and separator in request.prompt:
        return split_text(request.prompt, separator, tokenizer)
    return None


async def render_chunked(serving: Any, request: Any) -> list[Any] | Any | None:
    """Engine inputs (or an error object) for a chunked prompt; None otherwise."""
    config = settings_of(serving.engine_client.vllm_config)
    if not config.enable_chunk_cache:
        if (request.model_extra or {}).get(BODY_FIELD) is not None:
            return serving.create_error_response(
                f"{BODY_FIELD} needs a server started with --enable-chunk-cache",
                param=BODY_FIELD,
            )
        return None
    try:
        segments = segments_of(
            request, config.chunk_separator, serving.renderer.get_tokenizer()
        )
        if segments is None:
            return None
        token_ids, lengths = chunked_prompt(segments)
        max_len = serving.model_config.max_model_len
        if len(token_ids) >= max_len:
            raise VLLMValidationError(
                f"the chunked prompt has {len(token_ids)} tokens; this model's "
                f"context length is {max_len}",
                parameter="prompt",
            )
    except (VLLMValidationError, ValueError) as e:
        return serving.create_error_response(str(e), param=BODY_FIELD)
    return [chunked_input(request, token_ids, lengths)]


def chunked_input(
    request: Any,
    token_ids: list[int],
    lengths: list[int],
    documents: list[int] | None = None,
) -> Any:
    """The engine input of a chunked HTTP request (completion or chat): its
    token ids, with the chunk lengths (and which chunks are documents, when
    not every chunk after the first) added to ``request.vllm_xargs`` as
    sealed internal keys, which upstream copies into ``extra_args``."""
    keys: dict[str, Any] = {CHUNKS: lengths}
    if documents is not None and documents != [1, len(lengths)]:
        keys[DOCUMENTS] = documents
    request.vllm_xargs = {**(request.vllm_xargs or {}), **seal(keys)}
    return tokens_input(token_ids, cache_salt=request.cache_salt)
