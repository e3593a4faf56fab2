"""Chunks reused in new company, tried in Hugging Face with exact masks.

The reuse workload of ``benchmarks/chunk_quality.py`` (reuse_workload.py:
pools of 8 documents, each first seen in one of two prompts of 4, then warm
prompts of 4 of the pool in new combinations and orders, never after a
neighbour a chunk was computed with; one question per document a prompt),
answered by SmolLM2-135M-Instruct in float32 in transformers, with the store
and the recomputation made explicit as in chunk_recompute_reference.py
(whose helpers this script shares: loaded rows as stored, recomputed tokens
in one pass attending causally to everything before them). Modes are
``+``-joined, a base first:

- ``full``: full attention, plain vLLM;
- ``isolated``: every chunk computed alone (the engine's fills until issue 36);
- ``inplace``: every chunk as computed in its first-sight prompt (exact full
  attention there, at its first-sight positions), its keys moved by RoPE to
  where it stands: what an engine stores that computes missing chunks in
  place. A first sight is then plain vLLM, so its answers are full's;
- ``fusion:N``: FusionRAG's offline stage, every chunk computed after the
  system prompt and the N pool documents most like it (tf-idf cosine over
  tokens), the most alike last;
- ``paths:RULE``: per-document answer paths (PCED, superposition prompting):
  each document answers on its own exact prefix, system prompt + document +
  question; the paths are scored by the question's log-likelihood given the
  document and combined by RULE: ``top1`` (the likeliest path answers),
  ``mix`` (next token from the paths' distributions weighted by the
  posterior of the question), ``pced`` (PCED's rule: the token with the most
  support from any path, (1 + b) log p_k - b log p_0 + log r_k, p_0 the
  system prompt alone, r the posterior, b = 0.5), ``answer`` (every path
  answers; the answer the model finds likeliest, per token, wins) and
  ``joint`` (the path whose question and answer together are likeliest).

Then, for ``inplace``, a store policy for a chunk first seen right after the
system prompt (no document before it): ``keep`` (the default), ``replace``
(recomputed in place, whole, the next time it stands after another
document, and stored as computed there) or ``both`` (both variants kept: the
first where the chunk stands first again, the one computed in company
elsewhere). Then the recomputed tokens: ``head:K``, ``tail:F`` and the other
parts of chunk_recompute_reference.py, and the question-aware choices of
ProphetKV and QCFuse: ``qattn:F`` (the F of chunk tokens the question
attends to most, its attention on the loaded KV, each layer's normalised and
summed) and ``qsent:F`` (whole sentences by that attention, up to F).
Every mode answers the same token ids; differences against full attention
are paired, by question and clustered by prompt.

    .venv/bin/python benchmarks/chunk_reuse_reference.py --generator sheets \\
        --sets 13 --results docs/chunk_reuse_reference_sheets.json \\
        --lock /tmp/kvreuse-cpu.lock --modes full inplace \\
        inplace+head:64+tail:0.125 paths:top1 ...
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
from chunk_quality import Item, Prompts, is_right
from chunk_recompute_reference import KV, forward, kv_of, prepare, recompute
from chunk_recompute_reference import positions as span_positions
from quality_report import clustered, paired
from reuse_choose import choose_answer
from reuse_paths import path_answer
from reuse_workload import GENERATORS, reuse_sets
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

Variant = tuple[KV, int]  # a chunk's stored rows and the position it starts at
SPANS = {"head", "tail", "dev", "attr", "facts", "names"}
BATCH = 6  # modes answered in one batch (their KVs held at once)


def rows(kv: KV, start: int, stop: int) -> KV:
    return [(k[:, :, start:stop], v[:, :, start:stop]) for k, v in kv]


def joined(parts: list[KV]) -> KV:
    return [
        (torch.cat([p[n][0] for p in parts], 2), torch.cat([p[n][1] for p in parts], 2))
        for n in range(len(parts[0]))
    ]


def moved(model, variant: Variant, start: int) -> KV:
    """``variant``'s rows with keys moved by RoPE to start at ``start``
    (a rotation by the difference: exact, either way)."""
    kv, stored = variant
    if start == stored:
        return kv
    keys = kv[0][0]
    delta = torch.full((1, keys.shape[2]), start - stored)
    cos, sin = model.model.rotary_emb(keys, delta)
    return [(apply_rotary_pos_emb(k, k, cos, sin)[1], v) for k, v in kv]


class Pool:
    """One set: its documents and the variants a store may hold of each,
    computed once, when first asked for."""

    def __init__(self, model, prompts: Prompts, documents: list[list[int]]) -> None:
        self.model, self.documents = model, documents
        self.system = prompts.system
        self.tokenizer = prompts.tokenizer
        self.first: dict[int, Variant] = {}  # as computed at first sight
        self.place: dict[int, int] = {}  # where it stood then (0: first)
        self.system_kv: KV = []
        self.variants: dict[tuple[str, int], Variant] = {}
        self.memo: dict = {}  # reuse_paths' answers, per documents and question

    def record_first(self, full: KV, starts: list[int], order: list[int]) -> None:
        self.system_kv = rows(full, 0, starts[1])
        for place, doc in enumerate(order):
            start = starts[place + 1]
            self.first[doc] = (
                rows(full, start, start + len(self.documents[doc])),
                start,
            )
            self.place[doc] = place

    def after(self, doc: int, context: list[int]) -> Variant:
        ids = context + self.documents[doc]
        return rows(kv_of(forward(self.model, ids, 0)), len(context), len(ids)), len(
            context
        )

    def variant(self, kind: str, doc: int) -> Variant:
        """``alone`` (no context), ``solo`` (after the system prompt) or
        ``fusionN`` (after the system prompt and the N most alike)."""
        if (kind, doc) not in self.variants:
            if kind == "alone":
                context = []
            elif kind == "solo":
                context = list(self.system)
            else:
                alike = self.alike(doc)[: int(kind[len("fusion") :])]
                context = self.system + [
                    t for d in reversed(alike) for t in self.documents[d]
                ]
            self.variants[kind, doc] = self.after(doc, context)
        return self.variants[kind, doc]

    def alike(self, doc: int) -> list[int]:
        """The other documents, the most alike first (tf-idf cosine)."""
        counts = [Counter(d) for d in self.documents]
        df = Counter(t for c in counts for t in c)
        n = len(counts)

        def vector(c: Counter) -> dict[int, float]:
            return {t: f * math.log(n / df[t]) for t, f in c.items()}

        vectors = [vector(c) for c in counts]

        def cosine(a: dict, b: dict) -> float:
            dot = sum(w * b.get(t, 0.0) for t, w in a.items())
            norm = math.sqrt(
                sum(w * w for w in a.values()) * sum(w * w for w in b.values())
            )
            return dot / norm if norm else 0.0

        others = [d for d in range(n) if d != doc]
        return sorted(others, key=lambda d: -cosine(vectors[doc], vectors[d]))


def parse(mode: str) -> dict[str, str]:
    parts = mode.split("+")
    base, _, arg = parts[0].partition(":")
    out = {"base": base, "arg": arg, "policy": "keep"}
    for part in parts[1:]:
        kind, _, value = part.partition(":")
        if kind in ("keep", "replace", "both"):
            out["policy"] = kind
        else:
            out[kind] = value
    return out


def pick(spec: dict, pool: Pool, doc: int, where: int, state: dict) -> Variant | None:
    """The variant ``spec`` loads for ``doc`` standing ``where``-th; None
    where the policy computes it in place (its first time in company)."""
    if spec["base"] == "isolated":
        return pool.variant("alone", doc)
    if spec["base"] == "fusion":
        return pool.variant(f"fusion{spec['arg'] or 2}", doc)
    first, policy = pool.first[doc], spec["policy"]
    if pool.place[doc] != 0 or policy == "keep" or (policy == "both" and where == 0):
        return first
    if doc in state:
        return state[doc]
    return first if where == 0 else None


def attention_scores(model, kv: KV, at: int, question: list[int]) -> torch.Tensor:
    """Each loaded position's attention from the question's tokens: mean
    over heads and question tokens, each layer normalised, summed."""
    cache = DynamicCache()
    for number, (k, v) in enumerate(kv):
        cache.update(k, v, number)
    model.set_attn_implementation("eager")
    try:
        out = model(
            input_ids=torch.tensor([question]),
            position_ids=torch.arange(at, at + len(question))[None],
            past_key_values=cache,
            output_attentions=True,
            logits_to_keep=1,
        )
    finally:
        model.set_attn_implementation("sdpa")
    score = torch.zeros(at)
    for attention in out.attentions:
        layer = attention[0, :, :, :at].mean((0, 1))
        score += layer / layer.sum()
    return score


def question_positions(spec: dict, prompt, score: torch.Tensor) -> set[int]:
    """``qattn``: the top tokens by ``score``; ``qsent``: whole sentences
    by their summed score, the highest first, up to the share."""
    chosen: set[int] = set()
    score = score.clone()
    score[: prompt.lengths[0]] = -1
    if "qattn" in spec:
        budget = round(float(spec["qattn"]) * prompt.body)
        chosen |= set(torch.topk(score, budget).indices.tolist())
    if "qsent" in spec:
        budget = round(float(spec["qsent"]) * prompt.body)
        ranked = sorted(
            prompt.sentences, key=lambda s: -float(score[s[0] : s[1]].sum())
        )
        taken: set[int] = set()
        for first, stop in ranked:
            if len(taken) + stop - first > budget:
                break
            taken.update(range(first, stop))
        chosen |= taken
    return chosen


def mode_kvs(model, pool, prompt, order, items, cold, mode, state) -> dict:
    """What ``mode`` answers ``items`` (questions on one prompt) from: key ->
    (KV, recomputed share), or key -> text for answer paths; updates the
    store ``state`` (a policy's variants computed in company)."""
    spec = parse(mode)
    if spec["base"] == "full" or (cold and spec["base"] == "inplace"):
        return {key: (prompt.full, 1.0) for key, _ in items}  # first sight: exact
    if spec["base"] == "paths":
        return {key: path_answer(model, pool.tokenizer, pool, order,
                                 item.segments[-1], spec["arg"], item.max_tokens)
                for key, item in items}  # fmt: skip
    if spec["base"] == "choose":
        return {key: choose_answer(model, pool, order, item, spec, moved, answer_many)
                for key, item in items}  # fmt: skip
    parts, forced, fresh = [rows(prompt.full, 0, prompt.lengths[0])], set(), []
    for where, doc in enumerate(order):
        start, length = prompt.starts[where + 1], prompt.lengths[where + 1]
        variant = pick(spec, pool, doc, where, state)
        if variant is None:  # computed in place, whole: rows as placeholders
            forced.update(range(start, start + length))
            fresh.append((doc, start, length))
            variant = pool.first[doc]
        parts.append(moved(model, variant, start))
    base = joined(parts)
    spans = "+".join(f"{k}:{v}" for k, v in spec.items() if k in SPANS)
    fixed = forced | set(span_positions(spans, prompt, base, "")) if spans else forced
    out: dict = {}
    for key, item in items:
        if "qattn" in spec or "qsent" in spec:
            score = attention_scores(model, base, prompt.end, item.segments[-1])
            chosen = sorted(fixed | question_positions(spec, prompt, score))
            out[key] = (
                recompute(model, prompt, base, chosen),
                len(chosen) / prompt.body,
            )
        elif not out:
            chosen = sorted(fixed)
            out[key] = (
                recompute(model, prompt, base, chosen),
                len(chosen) / prompt.body,
            )
        else:
            out[key] = next(iter(out.values()))
        for doc, start, length in fresh:
            state.setdefault(doc, (rows(out[key][0], start, start + length), start))
    return out


@torch.no_grad()
def answer_many(
    model, tokenizer, kvs: list[KV], at: int, question: list[int], steps: int = 8
) -> list[str]:
    """Greedy answers to ``question`` after each of ``kvs`` (all ``at``
    long), in one batch: up to ``steps`` tokens, to a newline or the end of
    turn (where vLLM stops)."""
    cache = DynamicCache()
    for n in range(len(kvs[0])):
        cache.update(
            torch.cat([kv[n][0] for kv in kvs]), torch.cat([kv[n][1] for kv in kvs]), n
        )
    feed = torch.tensor([question] * len(kvs))
    tokens: list[list[int]] = [[] for _ in kvs]
    done = [False] * len(kvs)
    for _ in range(steps):
        logits = model(
            input_ids=feed,
            position_ids=torch.arange(at, at + feed.shape[1])[None].expand(
                len(kvs), -1
            ),
            past_key_values=cache,
            logits_to_keep=1,
        ).logits[:, -1]
        at += feed.shape[1]
        feed = logits.argmax(-1)[:, None]
        for row, token in enumerate(feed[:, 0].tolist()):
            if done[row] or token == tokenizer.eos_token_id:
                done[row] = True
                continue
            tokens[row].append(token)
            done[row] = "\n" in tokenizer.decode(tokens[row])
        if all(done):
            break
    return [tokenizer.decode(t).split("\n")[0] for t in tokens]


def run_prompt(model, pool, prompt, order, items, cold, due, states, results) -> None:
    """Every mode of ``due`` on one prompt's questions, answered in batches
    of BATCH modes (their KVs held at once)."""
    tokenizer = pool.tokenizer
    for first in range(0, len(due), BATCH):
        answers: dict[str, list] = {}
        for mode in due[first : first + BATCH]:
            for key, got in mode_kvs(model, pool, prompt, order, items, cold, mode,
                                     states[mode]).items():  # fmt: skip
                if isinstance(got, str):  # answer paths' text
                    results[mode][key] = [None, 0.0, got]
                elif isinstance(got[0], str):  # choose: text, documents kept
                    results[mode][key] = [None, 0.0, got[0], got[1]]
                else:
                    answers.setdefault(key, []).append((mode, *got))
        for key, item in items:
            batch = answers.get(key, [])
            if not batch:
                continue
            texts = answer_many(model, tokenizer, [kv for _, kv, _ in batch],
                                prompt.end, item.segments[-1],
                                item.max_tokens)  # fmt: skip
            for (mode, _, share), text in zip(batch, texts, strict=True):
                results[mode][key] = [None, share, text]
        for key, item in items:
            for mode in due[first : first + BATCH]:
                got = results[mode][key]
                got[0] = is_right(item, got[2])


def run_set(model, prompts, rset, number, modes, results) -> bool:
    """Every mode not yet done on set ``number``, whole (a store policy
    depends on the order of the set's prompts); False if none was due."""
    keys = question_keys(rset.items, number)
    due = [m for m in modes if not all(k in results.get(m, {}) for k in keys)]
    if not due:
        return False
    pool = Pool(model, prompts, rset.documents)
    states: dict[str, dict] = {m: {} for m in due}
    for mode in due:
        results.setdefault(mode, {})
    for kind, orders in (("c", rset.first), ("w", rset.warm)):
        for index, order in enumerate(orders):
            mine = [
                (k, i)
                for k, i in keys.items()
                if k.startswith(f"{number}.{kind}{index}.")
            ]
            prompt = prepare(model, prompts.tokenizer, mine[0][1].segments)
            if kind == "c":
                pool.record_first(prompt.full, prompt.starts, order)
            run_prompt(
                model, pool, prompt, order, mine, kind == "c", due, states, results
            )
            pool.memo.clear()  # a prompt's paths: ~150 MB a question, not reused
    return True


def question_keys(items: list[Item], number: int) -> dict[str, Item]:
    """``SET.PROMPT.J`` -> the J-th question on that prompt (the one-document
    questions first: the keys of the runs before two-document questions)."""
    keys: dict[str, Item] = {}
    count: Counter[str] = Counter()
    for item in items:
        prompt = item.prompt.split(".")[1]
        keys[f"{number}.{prompt}.{count[prompt]}"] = item
        count[prompt] += 1
    return keys


def report(results: dict, modes: list[str], two_doc: dict[str, bool]) -> None:
    """Per mode and question kind (one document, two): first-sight and warm
    accuracy, each paired against full attention (per question; by prompt),
    and the share recomputed or the documents kept, warm."""
    full = results.get("full", {})
    print(
        "| mode | questions | first sight | vs full (paired 95%; by prompt) | "
        "warm | vs full (paired 95%; by prompt) | recomputed or kept, warm |"
    )
    print("|---|---|---|---|---|---|---|")
    for mode in modes:
        done = results.get(mode, {})
        for two in sorted({two_doc.get(k, False) for k in done}):
            cells = []
            for kind in (".c", ".w"):
                keys = sorted(k for k in done if kind in k and k in full
                              and two_doc.get(k, False) == two)  # fmt: skip
                cells += _cells(mode, keys, done, full)
            warm = [v for k, v in done.items()
                    if ".w" in k and two_doc.get(k, False) == two]  # fmt: skip
            kept = [v[3] for v in warm if len(v) > 3]
            share = "-"
            if kept:
                share = f"{statistics.mean(kept):.2f} documents"
            elif warm:
                share = f"{statistics.mean(v[1] for v in warm):.1%}"
            what = "two documents" if two else "one document"
            print(f"| {mode} | {what} | {' | '.join(cells)} | {share} |")


def _cells(mode: str, keys: list[str], done: dict, full: dict) -> list[str]:
    """Accuracy and the paired difference against full attention."""
    if not keys:
        return ["-", "-"]
    mine = [done[k][0] for k in keys]
    theirs = [full[k][0] for k in keys]
    right = f"{sum(mine) / len(mine):.1%} ({sum(mine)}/{len(mine)})"
    diff = "-"
    if mode != "full" and len(keys) > 1:
        mean, half = paired(mine, theirs)
        _, by = clustered(mine, theirs, [k.rsplit(".", 1)[0] for k in keys])
        diff = f"{mean:+.1%} ± {half:.1%} (± {by:.1%})"
    return [right, diff]


@contextlib.contextmanager
def held(path: str | None):
    """The shared CPU lock, held while a set runs (others run between)."""
    if path is None:
        yield
        return
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/smollm2")
    parser.add_argument("--generator", choices=GENERATORS, default="profiles")
    parser.add_argument("--workload", choices=("reuse", "fixed"), default="reuse",
                        help="fixed: warm prompts in first-sight order")  # fmt: skip
    parser.add_argument("--sets", type=int, default=3)
    parser.add_argument("--first-set", type=int, default=0)
    parser.add_argument("--warm-prompts", type=int, default=4)
    parser.add_argument("--per-doc", type=int, default=1,
                        help="one-document questions per document")  # fmt: skip
    parser.add_argument("--pairs", action="store_true",
                        help="also two-document questions (neighbours)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="other pools")
    parser.add_argument("--modes", nargs="+", default=["full", "inplace"])
    parser.add_argument("--results", help="JSON: answers kept, runs resumed")
    parser.add_argument("--lock", help="a lock file held while each set runs")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    prompts = Prompts(args.model)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    options = argparse.Namespace(sets=args.sets, pool=8, docs=4, doc_tokens=500,
                                 warm_prompts=args.warm_prompts,
                                 per_doc=args.per_doc, pairs=args.pairs,
                                 seed=args.seed)  # fmt: skip
    sets = reuse_sets(prompts, GENERATORS[args.generator](args.seed), options, Item,
                      same_order=args.workload == "fixed")  # fmt: skip
    saved = Path(args.results) if args.results else None
    results = json.loads(saved.read_text()) if saved and saved.exists() else {}
    meta = {"generator": args.generator, "workload": args.workload}
    # Left out at their defaults, so the results of earlier runs still load.
    defaults = {"per_doc": 1, "pairs": False, "seed": 0, "warm_prompts": 4}
    meta.update({k: getattr(args, k) for k, d in defaults.items()
                 if getattr(args, k) != d})  # fmt: skip
    if results.pop("_args", meta) != meta:
        raise SystemExit(f"{saved} holds another workload's results")
    for number in range(args.first_set, args.sets):
        started = time.perf_counter()
        with held(args.lock):
            ran = run_set(model, prompts, sets[number], number, args.modes, results)
        if saved is not None and ran:
            saved.write_text(json.dumps({"_args": meta, **results}))
        print(f"set {number + 1}/{args.sets} ({time.perf_counter() - started:.0f} s)",
              flush=True)  # fmt: skip
    kinds = {k: i.two_hop for n, rset in enumerate(sets)
             for k, i in question_keys(rset.items, n).items()}  # fmt: skip
    report(results, args.modes, kinds)


if __name__ == "__main__":
    main()
