"""Choose, then combine (issue 44), in Hugging Face.

Answer paths (benchmarks/reuse_paths.py) score every document by the
question's log-likelihood on its own exact prefix (system prompt, document,
question) and answer on the likeliest alone, so a question that needs two
documents gets one document's answer. Choosing then combining keeps the
documents whose score per question token is within ``margin`` of the best
(at least one, at most ``k``: the likeliest first, then shown in the
client's order), then answers jointly over the system prompt and the kept
documents:

- one kept: exactly the ``top1`` path's answer (nothing to combine);
- several, ``inplace`` (the default here): the kept documents computed
  with full attention, as a prompt of the system prompt and those
  documents (the first kept is its path's prefix, cached; the others are
  computed after it);
- several, ``moved``: the first kept exact, each further one loaded as its
  path computed it (right after the system prompt), its keys moved by RoPE
  to where it stands, and the engine's default tokens recomputed (each
  chunk's first 64, the last 12.5% of the chunk tokens).

The score per token does not grow with the question's length, so one
margin serves short and long questions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from chunk_recompute_reference import positions as span_positions
from chunk_recompute_reference import prepare, recompute
from reuse_paths import rule_answer, scored

DEFAULT_SPANS = "head:64+tail:0.125"  # the engine's default recompute


def kept_documents(per_token: list[float], margin: float, k: int) -> list[int]:
    """Indices of the documents within ``margin`` of the best score, the
    best ``k`` of them (ties: the earlier), in their order."""
    best = max(per_token)
    close = [i for i, s in enumerate(per_token) if s >= best - margin]
    ranked = sorted(close, key=lambda i: (-per_token[i], i))[: max(k, 1)]
    return sorted(ranked)


def choose_answer(
    model,
    pool,
    order: list[int],
    item: Any,
    spec: dict[str, str],
    move: Callable[..., Any],
    answer: Callable[..., list[str]],
) -> tuple[str, int]:
    """``item``'s answer on the documents ``order`` by choose-then-combine
    (``spec``: ``arg`` "MARGIN:K", ``moved`` present for moved loads);
    returns (text, documents kept)."""
    margin, _, k = spec["arg"].partition(":")
    question = item.segments[-1]
    paths = scored(model, pool, order, question)
    kept = kept_documents(paths.per_token(), float(margin), int(k or 4))
    if len(kept) == 1:
        text = rule_answer(model, pool.tokenizer, paths, "top1", item.max_tokens)
        return text, 1
    docs = tuple(order[i] for i in kept)
    key = ("joint", docs, "moved" in spec)
    if key not in pool.memo:
        pool.memo[key] = _joint_kv(model, pool, docs, "moved" in spec, move)
    kv, end = pool.memo[key]
    (text,) = answer(model, pool.tokenizer, [kv], end, question, item.max_tokens)
    return text, len(kept)


def _joint_kv(model, pool, docs: tuple[int, ...], moved: bool, move) -> tuple:
    """(KV, length) of the system prompt and ``docs``: full attention, or
    with every document after the first loaded as its path computed it,
    moved, and the default spans recomputed."""
    segments = [pool.system, *(pool.documents[d] for d in docs), []]
    prompt = prepare(model, pool.tokenizer, segments)  # full attention
    if not moved:
        return prompt.full, prompt.end
    parts = [_rows(prompt.full, 0, prompt.starts[2])]  # system + first: exact
    for where, doc in enumerate(docs[1:], start=2):
        parts.append(move(model, pool.variant("solo", doc), prompt.starts[where]))
    base = _joined(parts)
    chosen = span_positions(DEFAULT_SPANS, prompt, base, "")
    return recompute(model, prompt, base, chosen), prompt.end


def _rows(kv: list, start: int, stop: int) -> list:
    return [(k[:, :, start:stop], v[:, :, start:stop]) for k, v in kv]


def _joined(parts: list[list]) -> list:
    import torch

    return [
        (torch.cat([p[n][0] for p in parts], 2), torch.cat([p[n][1] for p in parts], 2))
        for n in range(len(parts[0]))
    ]
