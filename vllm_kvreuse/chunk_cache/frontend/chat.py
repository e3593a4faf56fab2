"""Chunked chat completions: the chunk cache behind /v1/chat/completions.

Two opt-in ways, both through the served model's own chat template:

- ``"chunk_messages": true`` in the body: every message before the last is a
  chunk (the system message too), and so is each of vLLM's ``documents``
  where the template renders it; the last message plus the generation
  prompt is the question;
- ``--chunk-separator SEP`` (the server's flag): a rendered conversation
  that holds ``SEP`` is split there, exactly as a text prompt is, and the
  separators are not model input.

vLLM renders the request as it would anyway (``OnlineRenderer.render_chat``,
the call ``OpenAIServingChat.render_chat_request`` makes); the cuts come from
more renderings of the same request with fewer messages or documents
(:mod:`vllm_kvreuse.chunk_cache.frontend.chat_split`). Each piece is tokenised alone,
and the pieces' tokens must be vLLM's tokens of the whole rendering, so the
chunked prompt is vLLM's prompt minus any separators. A template that cannot
be cut there, a body that cannot be chunked (not text, tools, an empty
message) and a bad ``chunk_messages`` are refused with a 400; a chat request
that asks for neither way is vLLM's, untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_kvreuse.chunk_cache.frontend import chat_split
from vllm_kvreuse.chunk_cache.frontend.chat_split import ChatSplitError
from vllm_kvreuse.chunk_cache.frontend.segments import chunked_input, chunked_prompt
from vllm_kvreuse.core.spec import Settings, settings_of

CHUNK_MESSAGES = "chunk_messages"
"""HTTP body field of a chat request: its messages before the last are chunks."""
MAX_PARTS = 256
"""Messages plus documents of a request chunked by messages: each is one more
rendering of the conversation, so their number bounds the cost."""


# -- the body -------------------------------------------------------------------


def wants_message_chunks(body: dict[str, Any]) -> bool:
    """Whether the body asks for ``chunk_messages`` (a JSON boolean or null)."""
    value = body.get(CHUNK_MESSAGES)
    if value is not None and not isinstance(value, bool):
        raise ChatSplitError(f"{CHUNK_MESSAGES} must be true or false, got {value!r}")
    return bool(value)


def _text_of(number: int, content: Any) -> str:
    """A message's text; :class:`ChatSplitError` for any other content."""
    if isinstance(content, str) or content is None:
        return content or ""
    if not isinstance(content, list):
        raise ChatSplitError(f"message {number}: unknown content in a chunked request")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ChatSplitError(
                f"message {number} has a {kind or 'non-text'} content part: a "
                "chunked chat request takes text only"
            )
        texts.append(part.get("text") or "")
    return "".join(texts)


def check_chunkable(request: Any) -> None:
    """A chunked chat request sends text messages, none empty, and no tools."""
    if request.tools:
        raise ChatSplitError("a chunked chat request cannot use tools")
    for number, message in enumerate(request.messages):
        if message.get("tool_calls") or message.get("role") in ("tool", "function"):
            raise ChatSplitError(
                f"message {number} is a tool call or result: a chunked chat "
                "request cannot use tools"
            )
        if not _text_of(number, message.get("content")):
            raise ChatSplitError(
                f"message {number} is empty: every message of a chunked chat "
                "request has text"
            )


# -- rendering ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Rendering:
    """One rendering of a request by vLLM: its conversation and engine input."""

    conversation: list[Any]
    engine_input: Any

    @property
    def text(self) -> str:
        return self.engine_input.get("prompt") or ""

    @property
    def token_ids(self) -> list[int]:
        return self.engine_input.get("prompt_token_ids") or []

    @property
    def is_text(self) -> bool:
        """A text-only token prompt (no media, no embeddings)."""
        engine_input = self.engine_input
        return engine_input.get("type") == "token" and "prompt" in engine_input


async def _render(serving: Any, request: Any, **update: Any) -> _Rendering:
    """A copy of ``request`` with ``update`` applied, rendered as vLLM renders
    it; a template's refusal of it is a :class:`ChatSplitError`."""
    try:
        result = await serving.online_renderer.render_chat(
            request.model_copy(update=update)
        )
    except Exception as e:  # whatever the template raises
        message = f"the chat template cannot render {_what(update)}: {e}"
        raise ChatSplitError(message) from e
    if not isinstance(result, tuple):  # an ErrorResponse
        raise ChatSplitError(
            f"the chat template cannot render {_what(update)}: {result.error.message}"
        )
    conversation, (engine_input,) = result
    rendering = _Rendering(conversation, engine_input)
    if not rendering.is_text:
        raise ChatSplitError("a chunked chat request takes text content only")
    return rendering


def _what(update: dict[str, Any]) -> str:
    if "messages" in update:
        return f"the first {len(update['messages'])} message(s) alone"
    count = len(update["documents"])
    return f"the conversation with {count} of its documents"


async def _message_cuts(serving: Any, request: Any, full: str) -> list[int]:
    """Where each message before the last ends in ``full``."""
    messages = request.messages
    prefixes = []
    for count in range(1, len(messages)):
        rendering = await _render(
            serving, request, messages=messages[:count],
            add_generation_prompt=False, continue_final_message=False,
        )  # fmt: skip
        prefixes.append(rendering.text)
    return chat_split.message_cuts(prefixes, full)


async def _document_cuts(serving: Any, request: Any, full: str) -> list[int]:
    """Where each of the request's ``documents`` starts and ends in ``full``."""
    documents = request.documents or []
    without = [
        (await _render(serving, request, documents=documents[:n] + documents[n + 1 :]))
        for n in range(len(documents))
    ]
    spans = chat_split.document_spans(full, [rendering.text for rendering in without])
    return [offset for span in spans for offset in span]


async def _segments(
    serving: Any, request: Any, full: _Rendering, by_messages: bool, separator: str
) -> tuple[list[list[int]], list[int]]:
    """The chunked prompt's segments (token ids, checked against vLLM's) and
    which of them are documents (:func:`_document_region`)."""
    text = full.text
    segments = [text]
    message_ends: list[int] = []
    document_spans: list[int] = []
    if by_messages:
        message_ends = await _message_cuts(serving, request, text)
        if request.documents:
            document_spans = await _document_cuts(serving, request, text)
        segments = chat_split.cut(text, message_ends + document_spans)
    pieces = chat_split.split_at_separator(segments, separator)
    tokenizer = serving.renderer.get_tokenizer()
    tokens = chat_split.tokenize_pieces(pieces, tokenizer, request.add_special_tokens)
    chat_split.check_tokens(pieces, tokens, full.token_ids)
    start, stop = await _document_region(
        serving, request, text, message_ends, document_spans
    )
    documents = chat_split.document_range(pieces, start, stop)
    return chat_split.segment_tokens(pieces, tokens), documents


async def _document_region(
    serving: Any,
    request: Any,
    text: str,
    message_ends: list[int],
    document_spans: list[int],
) -> tuple[int, int]:
    """Where the documents stand in the rendering: vLLM's ``documents``
    where the request sends them; else everything before the conversation's
    first assistant message (from it on, every message is a turn, kept
    whole in every answer path)."""
    if document_spans:
        return document_spans[0], document_spans[-1]
    messages = request.messages[:-1]
    first = next(
        (n for n, m in enumerate(messages) if m.get("role") == "assistant"), None
    )
    if first is None:
        return 0, len(text)
    if first == 0:
        return 0, 0
    if message_ends:
        return 0, message_ends[first - 1]
    (end,) = await _message_cuts_of(serving, request, text, first)
    return 0, end


async def _message_cuts_of(
    serving: Any, request: Any, text: str, count: int
) -> list[int]:
    """Where the first ``count`` messages end in ``text``."""
    rendering = await _render(
        serving, request, messages=request.messages[:count],
        add_generation_prompt=False, continue_final_message=False,
    )  # fmt: skip
    return chat_split.message_cuts([rendering.text], text)


# -- the spec's render_chat hook ------------------------------------------------


def _by_messages(request: Any, config: Settings) -> bool:
    """Whether the body asks for ``chunk_messages`` (and may)."""
    if not wants_message_chunks(request.model_extra or {}):
        return False
    if not config.enable_chunk_cache:
        raise ChatSplitError(
            f"{CHUNK_MESSAGES} needs a server started with --enable-chunk-cache"
        )
    if len(request.messages) < 2:
        raise ChatSplitError(
            f"{CHUNK_MESSAGES} needs at least two messages: the chunks, then the "
            "question"
        )
    if len(request.messages) + len(request.documents or []) > MAX_PARTS:
        raise ChatSplitError(
            f"{CHUNK_MESSAGES} takes at most {MAX_PARTS} messages and documents"
        )
    check_chunkable(request)
    return True


async def render_chunked_chat(serving: Any, request: Any) -> Any | None:
    """The spec's ``render_chat``: ``(conversation, engine inputs)`` of a
    chunked chat request, an error object, or None for vLLM's own path."""
    config = settings_of(serving.engine_client.vllm_config)
    separator = config.chunk_separator if config.enable_chunk_cache else ""
    param = CHUNK_MESSAGES if CHUNK_MESSAGES in (request.model_extra or {}) else None
    try:
        by_messages = _by_messages(request, config)
    except ChatSplitError as e:
        return serving.create_error_response(str(e), param=param)
    if not by_messages and not separator:
        return None
    # What OpenAIServingChat.render_chat_request does (its _preflight through
    # the engine client's public checks; the model check follows in the
    # shared render wrapper), then the cuts.
    engine = serving.engine_client
    if engine.errored:
        raise engine.dead_error
    engine.check_admission(request.n or 1)
    result = await serving.online_renderer.render_chat(request)
    if not isinstance(result, tuple):
        return result  # vLLM's own error
    full = _Rendering(result[0], result[1][0])
    if not by_messages and separator not in full.text:
        return result  # holds no separator: vLLM's rendering, as is
    try:
        if not full.is_text:
            raise ChatSplitError("a chunked chat request takes text content only")
        check_chunkable(request)
        segments, documents = await _segments(
            serving, request, full, by_messages, separator
        )
        token_ids, lengths = chunked_prompt(segments)
    except (ChatSplitError, ValueError) as e:
        return serving.create_error_response(str(e), param=param or "messages")
    engine_input = chunked_input(request, token_ids, lengths, documents)
    return full.conversation, [engine_input]
