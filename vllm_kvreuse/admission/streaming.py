"""Streams end with a ``cache_threshold`` chunk even when nothing was generated.

vLLM's completion and chat stream generators skip an output that has no
text, no token ids and no earlier tokens ("chunked prefill case"), even when
it carries a finish reason. A request rejected on admission is exactly such an
output, so its stream would close with ``[DONE]`` and no finish reason at
all. The wrapper below watches the engine results for rejections and, if the
original generator emitted no finishing chunk for that choice, adds one just
before the trailing usage chunk or ``[DONE]``. Registered in
:mod:`vllm_kvreuse.patches`.
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)

from vllm_kvreuse.admission.policy import FINISH_REASON

_DONE = "data: [DONE]\n\n"


class _StreamState:
    """Which choices were rejected, and which got a finishing chunk."""

    def __init__(self, num_choices: int, keyed_by_prompt: bool) -> None:
        self.num_choices = num_choices
        self.keyed_by_prompt = keyed_by_prompt
        self.rejected: set[int] = set()
        self.finished: set[int] = set()
        self.response_id: str | None = None
        self.created: int | None = None

    async def watch(self, results: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """Passes engine results through, noting rejected choices."""
        async for item in results:
            prompt_idx, result = item if self.keyed_by_prompt else (0, item)
            for output in result.outputs:
                if output.finish_reason == FINISH_REASON:
                    self.rejected.add(output.index + prompt_idx * self.num_choices)
            yield item

    def note(self, event: str) -> bool:
        """Records the chunk's finished choices; True if it ends the choices."""
        if event == _DONE:
            return True
        payload = json.loads(event.removeprefix("data: "))
        self.response_id = self.response_id or payload.get("id")
        self.created = self.created or payload.get("created")
        choices = payload.get("choices") or []
        self.finished.update(c["index"] for c in choices if c.get("finish_reason"))
        return not choices and payload.get("usage") is not None

    @property
    def missing(self) -> list[int]:
        return sorted(self.rejected - self.finished)


def _finishing_chunk(chat: bool, state: _StreamState, fallback: dict[str, Any]) -> str:
    common = dict(
        id=state.response_id or fallback["request_id"],
        created=state.created or fallback.get("created_time") or int(time.time()),
        model=fallback["model_name"],
    )
    response: ChatCompletionStreamResponse | CompletionStreamResponse
    if chat:
        response = ChatCompletionStreamResponse(
            choices=[
                ChatCompletionResponseStreamChoice(
                    index=i,
                    delta=DeltaMessage(),
                    finish_reason=FINISH_REASON,
                    stop_reason=FINISH_REASON,
                )
                for i in state.missing
            ],
            **common,
        )
    else:
        response = CompletionStreamResponse(
            choices=[
                CompletionResponseStreamChoice(
                    index=i,
                    text="",
                    finish_reason=FINISH_REASON,
                    stop_reason=FINISH_REASON,
                )
                for i in state.missing
            ],
            **common,
        )
    return f"data: {response.model_dump_json(exclude_unset=True)}\n\n"


def wrap_stream_generator(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)
    # completion_stream_generator gets (prompt_idx, result) pairs and
    # engine_inputs; the chat one gets bare results.
    keyed_by_prompt = "engine_inputs" in signature.parameters

    async def stream(self: Any, *args: Any, **kwargs: Any) -> AsyncGenerator[str, None]:
        bound = signature.bind(self, *args, **kwargs)
        arguments = bound.arguments
        state = _StreamState(arguments["request"].n or 1, keyed_by_prompt)
        arguments["result_generator"] = state.watch(arguments["result_generator"])
        async for event in original(*bound.args, **bound.kwargs):
            if state.rejected and state.note(event) and state.missing:
                yield _finishing_chunk(not keyed_by_prompt, state, arguments)
                state.finished.update(state.missing)
            yield event

    return stream
