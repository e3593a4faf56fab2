"""Per-document answer paths (PCED, superposition prompting), in Hugging Face.

Each document of a prompt answers on its own exact prefix: the system
prompt, the document right after it, the question (what vLLM's prefix cache
reuses as it is, with no keys moved). A path is scored by the question's
log-likelihood given its document (superposition prompting's saliency: the
question names what it asks about, so the document about it makes the
question likely), and the paths are combined by a rule:

- ``top1``: the likeliest path answers (superposition prompting, pruned to one);
- ``mix``: each next token from the paths' distributions weighted by the
  question's posterior over the paths (a Bayesian mixture);
- ``pced``: PCED's rule, the token with the most support from any path,
  ``(1 + b) log p_k - b log p_0 + log r_k``, p_0 the system prompt alone (the
  prior), r the posterior (standing in for PCED's retrieval scores), b = 0.5;
- ``answer``: every path answers; the answer the model finds likeliest per
  token wins;
- ``joint``: the path whose question and answer together are likeliest.

The paths of a question run as one batch (left-padded), scored once and
kept on the pool; each rule answers when a mode first asks for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

BETA = 0.5  # PCED's weight of the prior
STEPS = 8  # answer tokens, as the benchmark's answers


@dataclass(slots=True)
class Paths:
    """Several prefixes after the question, as one left-padded batch."""

    kv: list  # per layer (keys, values) [B, H, T, D], after the question
    mask: torch.Tensor  # [B, T]: 0 on padding
    at: torch.Tensor  # [B]: each path's next position
    logp: torch.Tensor  # [B, V]: next-token log-probabilities
    question: torch.Tensor  # [B]: log-likelihood of the question's tokens

    def rows(self, keep: list[int]) -> Paths:
        return Paths(
            [(k[keep], v[keep]) for k, v in self.kv], self.mask[keep],
            self.at[keep], self.logp[keep], self.question[keep],
        )  # fmt: skip


def cache_of(kv: list) -> DynamicCache:
    cache = DynamicCache()
    for number, (k, v) in enumerate(kv):
        cache.update(k, v, number)  # later tokens are concatenated: kv intact
    return cache


def open_paths(model, prefixes: list[list], question: list[int]) -> Paths:
    """``question`` after each prefix (per layer keys and values)."""
    lengths = [kv[0][0].shape[2] for kv in prefixes]
    width = max(lengths)

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, 0, width - t.shape[2], 0))

    kv = [
        (torch.cat([padded(p[n][0]) for p in prefixes]),
         torch.cat([padded(p[n][1]) for p in prefixes]))
        for n in range(len(prefixes[0]))
    ]  # fmt: skip
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
    count = len(question)
    cache = cache_of(kv)
    mask = torch.cat([mask, torch.ones(len(prefixes), count, dtype=mask.dtype)], 1)
    logits = model(
        input_ids=torch.tensor([question] * len(prefixes)),
        position_ids=torch.tensor(lengths)[:, None] + torch.arange(count)[None],
        attention_mask=mask,
        past_key_values=cache,
    ).logits
    logp = logits.log_softmax(-1)
    targets = torch.tensor(question[1:])[None, :, None].expand(len(prefixes), -1, 1)
    likelihood = logp[:, :-1].gather(2, targets)[..., 0].sum(1)
    kept = [(layer.keys, layer.values) for layer in cache.layers]
    return Paths(kept, mask, torch.tensor(lengths) + count, logp[:, -1], likelihood)


def decode(
    model,
    tokenizer,
    paths: Paths,
    choose: Callable[[torch.Tensor], torch.Tensor],
    steps: int = STEPS,
) -> list[tuple[str, float, int]]:
    """Greedy tokens, ``choose(log-probs [B, V]) -> [B]`` per step (one per
    path, or one for all), up to ``steps``: per path (text to a newline or
    the end of turn, summed log-prob of its tokens, their count)."""
    cache, mask, at, logp = cache_of(paths.kv), paths.mask, paths.at, paths.logp
    count = len(at)
    tokens: list[list[int]] = [[] for _ in range(count)]
    scores, done = [0.0] * count, [False] * count
    for _ in range(steps):
        chosen = choose(logp)
        for row, token in enumerate(chosen.tolist()):
            if done[row] or token == tokenizer.eos_token_id:
                done[row] = True
                continue
            tokens[row].append(token)
            scores[row] += float(logp[row, token])
            done[row] = "\n" in tokenizer.decode(tokens[row])
        if all(done):
            break
        mask = torch.cat([mask, torch.ones(count, 1, dtype=mask.dtype)], 1)
        logp = model(
            input_ids=chosen[:, None], position_ids=at[:, None],
            attention_mask=mask, past_key_values=cache, logits_to_keep=1,
        ).logits[:, -1].log_softmax(-1)  # fmt: skip
        at = at + 1
    return [
        (tokenizer.decode(t).split("\n")[0], s, max(len(t), 1))
        for t, s in zip(tokens, scores, strict=True)
    ]


@dataclass(slots=True)
class Scored:
    """One question's paths on one prompt: scored once, each rule answered
    when first asked for (``answers``: (rule, steps) -> text)."""

    every: Paths  # each document's path, then the system prompt alone's
    count: int  # documents
    question: list[int]
    answers: dict = field(default_factory=dict)

    @property
    def docs(self) -> Paths:
        return self.every.rows(list(range(self.count)))

    def per_token(self) -> list[float]:
        """Each path's question log-likelihood per scored token (the
        question's tokens after its first, as the engine scores them)."""
        tokens = max(len(self.question) - 1, 1)
        return [float(q) / tokens for q in self.every.question[: self.count]]


def scored(model, pool, order: list[int], question: list[int]) -> Scored:
    """``question``'s paths on the documents ``order`` (kept on the pool)."""
    key = (tuple(order), tuple(question))
    if key not in pool.memo:
        prefixes = [_prefix(pool, pool.variant("solo", doc)[0]) for doc in order]
        every = open_paths(model, [*prefixes, pool.system_kv], question)
        pool.memo[key] = Scored(every, len(order), list(question))
    return pool.memo[key]


def rule_answer(model, tokenizer, paths: Scored, rule: str, steps: int) -> str:
    """``rule``'s answer (module docstring), up to ``steps`` tokens."""
    if (rule, steps) in paths.answers:
        return paths.answers[rule, steps]
    docs, count = paths.docs, paths.count
    posterior = docs.question.log_softmax(0)
    greedy = lambda lp: lp.argmax(-1)  # noqa: E731
    if rule == "top1":
        best = int(posterior.argmax())
        text = decode(model, tokenizer, docs.rows([best]), greedy, steps)[0][0]
    elif rule in ("answer", "joint"):
        alone = decode(model, tokenizer, docs, greedy, steps)
        if rule == "answer":
            text = max(alone, key=lambda a: a[1] / a[2])[0]
        else:
            joint = [float(q) + a[1] for q, a in zip(docs.question, alone, strict=True)]
            text = alone[joint.index(max(joint))][0]
    elif rule == "mix":

        def mixed(lp: torch.Tensor) -> torch.Tensor:
            return (posterior[:, None] + lp).logsumexp(0).argmax().expand(count)

        text = decode(model, tokenizer, docs, mixed, steps)[0][0]
    elif rule == "pced":

        def pced(lp: torch.Tensor) -> torch.Tensor:
            support = (1 + BETA) * lp[:-1] - BETA * lp[-1] + posterior[:, None]
            return support.max(0).values.argmax().expand(count + 1)

        text = decode(model, tokenizer, paths.every, pced, steps)[0][0]
    else:
        raise ValueError(f"unknown path rule {rule!r}")
    paths.answers[rule, steps] = text
    return text


def _prefix(pool, doc_kv: list) -> list:
    """The system prompt's rows, then the document's (stored right after it)."""
    return [
        (torch.cat([sk, dk], 2), torch.cat([sv, dv], 2))
        for (sk, sv), (dk, dv) in zip(pool.system_kv, doc_kv, strict=True)
    ]


def path_answer(
    model, tokenizer, pool, order, question, rule: str, steps: int = STEPS
) -> str:
    paths = scored(model, pool, list(order), question)
    return rule_answer(model, tokenizer, paths, rule, steps)
