"""The fill context: documents every chunk is computed after.

A chunk computed alone begins like a prompt: nothing in its KV says that
other documents stand before it, and a small model then answers a question
about one document with another's facts. A fill context puts text of the
kind users retrieve (one or two typical documents, ``--chunk-fill-context
FILE``) before every chunk's fill, after the system prompt in "system"
mode, so each stored chunk is computed as a document that follows another.
It costs nothing at load time: the fills compute the context once (prefix
caching shares it between fills) and attend to it; a request loads its
chunks as before. Measured on the quality benchmark's profiles with one
other profile as the context (docs/chunk_cache.md, "Answer quality"); a
neutral passage in its place gained nothing there.

The context's tokens join every chunk key and every chunked request's block
salt: chunks stored under one context are never loaded under another.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any


def load_fill_context(vllm_config: Any, path: str) -> tuple[int, ...]:
    """The token ids of the text in ``path`` (UTF-8; ``""``: no context),
    encoded by the model's tokenizer as a chunk's text is, without special
    tokens. Raises ``ValueError`` naming the setting for an empty or
    unreadable file, or one of half the model's length or more."""
    if not path:
        return ()
    from vllm.tokenizers import cached_tokenizer_from_config

    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"chunk_fill_context: cannot read {path!r}: {error}") from None
    if not text.strip():
        raise ValueError(f"chunk_fill_context: {path!r} holds no text")
    tokenizer = cached_tokenizer_from_config(vllm_config.model_config)
    tokens = tuple(tokenizer.encode(text, add_special_tokens=False))
    limit = vllm_config.model_config.max_model_len // 2
    if len(tokens) >= limit:
        raise ValueError(
            f"chunk_fill_context has {len(tokens)} tokens: keep it under half of "
            f"--max-model-len ({limit}), for the chunks computed after it"
        )
    return tokens


def attention_tag(mode: str, context: Sequence[int]) -> str:
    """The attention mode as keys and block salts name it: the mode, and a
    short hash of the fill context's tokens when there is one."""
    if not context:
        return mode
    digest = hashlib.sha256(repr(tuple(context)).encode()).hexdigest()[:16]
    return f"{mode}+context:{digest}"
