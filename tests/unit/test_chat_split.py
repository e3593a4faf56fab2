"""Where a rendered chat is cut, on real chat templates rendered by
transformers with SmolLM2's tokenizer: message boundaries, documents, the
separator, and the token check that refuses a cut vLLM would not tokenise
the same way (the HTTP path: tests/e2e/test_rag_clients.py)."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_kvreuse.chunk_cache.frontend.chat_split import (
    ChatSplitError,
    Piece,
    check_tokens,
    cut,
    document_range,
    document_spans,
    message_cuts,
    segment_tokens,
    split_at_separator,
    tokenize_pieces,
)

MESSAGES = [
    {"role": "system", "content": "Answer from the documents."},
    {"role": "user", "content": "Document: The Kelmar Tower is in Lisbon."},
    {"role": "user", "content": "Document: The Vantor Bridge is in Oslo."},
    {"role": "user", "content": "In which city is the Kelmar Tower?"},
]
DOCUMENTS = [
    {"title": "tower", "text": "The Kelmar Tower is in Lisbon."},
    {"title": "bridge", "text": "The Vantor Bridge is in Oslo."},
]
TURNS = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Documents in the system turn, each after its title (as RAG templates do).
WITH_DOCUMENTS = (
    "{% if documents %}<|im_start|>system\nDocuments:{% for d in documents %}\n"
    "[{{ d.title }}] {{ d.text }}{% endfor %}<|im_end|>\n{% endif %}" + TURNS
)
# Each document numbered against the total: adding one rewrites the others.
COUNTED_DOCUMENTS = (
    "{% for d in documents %}Document {{ loop.index }} of {{ documents|length }}: "
    "{{ d.text }}\n{% endfor %}" + TURNS
)
# A header that counts the messages: no rendering is a prefix of the next.
COUNTED_MESSAGES = "{{ messages|length }} messages\n" + TURNS


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def render(tokenizer: Any, messages: list, template: str | None = None, **kw) -> str:
    return tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, **kw
    )


def prefixes(tokenizer: Any, template: str | None = None, **kw) -> list[str]:
    return [
        render(tokenizer, MESSAGES[:k], template, add_generation_prompt=False, **kw)
        for k in range(1, len(MESSAGES))
    ]


def test_smollm2_cuts_at_every_message_and_the_tokens_are_the_renderings(
    tokenizer,
) -> None:
    full = render(tokenizer, MESSAGES, add_generation_prompt=True)
    segments = cut(full, message_cuts(prefixes(tokenizer), full))
    assert len(segments) == len(MESSAGES)
    assert all(m["content"] in s for m, s in zip(MESSAGES, segments, strict=True))
    assert segments[-1].endswith("<|im_start|>assistant\n")  # the question
    pieces = split_at_separator(segments, "")
    tokens = tokenize_pieces(pieces, tokenizer, add_special_tokens=False)
    check_tokens(pieces, tokens, tokenizer.encode(full, add_special_tokens=False))
    assert segment_tokens(pieces, tokens) == tokens


def test_a_template_that_rewrites_earlier_messages_is_refused(tokenizer) -> None:
    full = render(tokenizer, MESSAGES, COUNTED_MESSAGES, add_generation_prompt=True)
    with pytest.raises(ChatSplitError, match="not a prefix of the whole"):
        message_cuts(prefixes(tokenizer, COUNTED_MESSAGES), full)


def test_a_message_rendered_as_nothing_is_refused() -> None:
    with pytest.raises(ChatSplitError, match="renders message 1 as nothing"):
        message_cuts(["ab", "ab"], "abc")


def without_each(tokenizer: Any, template: str | None, documents: list) -> list[str]:
    return [
        render(
            tokenizer, MESSAGES, template, documents=documents[:n] + documents[n + 1 :]
        )
        for n in range(len(documents))
    ]


@pytest.mark.parametrize("count", [1, 2, 3])
def test_documents_are_cut_where_the_template_renders_them(tokenizer, count) -> None:
    documents = [*DOCUMENTS, {"title": "tower", "text": "It is 120 metres tall."}]
    documents = documents[:count]
    full = render(tokenizer, MESSAGES, WITH_DOCUMENTS, documents=documents)
    spans = document_spans(full, without_each(tokenizer, WITH_DOCUMENTS, documents))
    texts = [full[a:b] for a, b in spans]
    if count == 1:  # the document brings the whole system turn that holds it
        assert texts == [full[: full.index("<|im_end|>") + len("<|im_end|>\n")]]
        return
    # (a newline right after a block tag is dropped: trim_blocks, as HF sets it)
    assert texts == [f"[{d['title']}] {d['text']}" for d in documents]


def test_documents_a_template_ignores_or_renumbers_are_refused(tokenizer) -> None:
    full = render(tokenizer, MESSAGES, documents=DOCUMENTS)
    with pytest.raises(ChatSplitError, match="does not render `documents`"):
        document_spans(full, without_each(tokenizer, None, DOCUMENTS))
    full = render(tokenizer, MESSAGES, COUNTED_DOCUMENTS, documents=DOCUMENTS)
    with pytest.raises(ChatSplitError, match="not one run of the rendering"):
        document_spans(full, without_each(tokenizer, COUNTED_DOCUMENTS, DOCUMENTS))


def test_the_separator_splits_and_is_dropped_empty_segments_refused() -> None:
    pieces = split_at_separator(["sys\n<doc>\nA", "B\n<doc>\nQ"], "\n<doc>\n")
    assert [(p.text, p.separator) for p in pieces] == [
        ("sys", False), ("\n<doc>\n", True), ("A", False),
        ("B", False), ("\n<doc>\n", True), ("Q", False),
    ]  # fmt: skip
    for text in ("a####b", "##a", "a##"):
        with pytest.raises(ChatSplitError, match="empty segment"):
            split_at_separator([text], "##")


def test_tokens_merged_across_a_cut_are_refused(tokenizer) -> None:
    """SmolLM2 merges '. ' with a following '##' into other tokens: dropping
    the separator's own tokens would not give vLLM's prompt."""
    text = "It is in Lisbon. ##The Vantor Bridge"
    pieces = split_at_separator([text], "##")
    tokens = tokenize_pieces(pieces, tokenizer, add_special_tokens=False)
    with pytest.raises(ChatSplitError, match="merges text across a chunk boundary"):
        check_tokens(pieces, tokens, tokenizer.encode(text, add_special_tokens=False))
    with pytest.raises(ChatSplitError, match="has more tokens"):
        check_tokens([Piece("a")], [[64]], [64, 65])


def test_documents_are_the_pieces_before_the_first_assistant_turn() -> None:
    """System prompt, two documents (one split at the separator), then an
    assistant turn and the question: the documents are pieces 1-3; from
    the assistant's turn on, turns; a region of vLLM's documents picks
    those only; none in the region: [1, 1]."""
    segments = ["<sys>", "docA##docB", "docC", "<assistant>", "<question>"]
    pieces = split_at_separator(segments, "##")
    turns_from = len("<sys>docA##docBdocC")
    assert document_range(pieces, 0, turns_from) == [1, 4]
    assert document_range(pieces, 0, len("".join(segments))) == [1, 5]
    assert document_range(pieces, len("<sys>"), len("<sys>docA##docB")) == [1, 3]
    assert document_range(pieces, 0, 0) == [1, 1]
