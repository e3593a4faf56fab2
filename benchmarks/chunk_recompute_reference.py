"""Which chunk tokens to recompute, tried in Hugging Face with exact masks.

The engine's segmented prefill recomputes contiguous spans (a chunk's head,
the chunks' tail, whole chunks); each span costs an engine step. This script
asks a wider question on the same documents and questions as
``benchmarks/chunk_quality.py`` (SmolLM2-135M-Instruct, float32, ~500-token
profiles, four a prompt): what if *any* set of tokens could be recomputed,
or the stored chunks computed differently? It runs the model in transformers
with the chunk cache's semantics made explicit:

- a loaded token's KV is its chunk's, computed after a *fill context* (none:
  ``isolated``; the system prompt: ``system``; the system prompt and N other
  documents of the same kind, from another seed: ``bridgeN``; the system
  prompt and a neutral passage: ``generic``), at its actual positions;
- the recomputed tokens run in one forward pass whose 4-D mask lets each
  attend causally to everything before it, loaded rows as stored: the same
  values a segmented prefill computes, for scattered tokens too;
- the question is answered greedily (8 tokens, up to a newline), as the
  benchmark's lead-in asks.

Modes are ``+``-joined parts: ``head:K`` (each chunk's first K tokens, EPIC),
``tail:F`` (the last F of the chunk tokens), ``dev:F@LAYERS`` (the F of chunk
tokens whose KV deviates most from full attention's at those layers:
CacheBlend's and KVShare's criterion with the true deviation, an upper bound
for any estimate of it), ``attr`` (in every document, the sentences stating
the asked attribute), ``facts`` (every fact sentence), ``names`` (every
sentence naming its person), ``base:CONTEXT`` (the fill context), and
``kscale:S`` (loaded keys scaled by S: an attention temperature, as APE).
Every mode answers the same token ids, so differences against full
attention are paired.

    .venv/bin/python benchmarks/chunk_recompute_reference.py --sets 12 \\
        --results docs/chunk_recompute_reference.json \\
        --modes full isolated head:32+tail:0.125 dev:0.15@all ...
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch
from chunk_quality import Prompts, accuracy_items  # benchmarks/ is on sys.path
from quality_data import People
from reuse_workload import GENERATORS
from transformers import AutoModelForCausalLM, DynamicCache

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, H, T, D]
NEUTRAL = (
    "The valley lies between two long ridges of low hills, and a slow river "
    "runs through it from north to south. In spring the river rises with the "
    "melting snow, and the meadows along its banks turn green within weeks. "
    "Farmers have grown wheat, barley and beans there for centuries, and old "
    "stone walls divide the fields. A narrow road follows the river past small "
    "villages, each with a church, a bakery and a square for the weekly "
    "market, where people trade vegetables, cheese, honey, wool and tools. "
    "Summers are warm and dry; in autumn the forests on the ridges turn yellow "
    "and red; winters are cold but short. The valley was once a route for "
    "merchants carrying salt and cloth between the coast and the mountains, "
    "and some of their inns still stand as houses or small museums. The old "
    "monastery on the hill is now a library whose records of harvests, floods "
    "and droughts go back several hundred years."
)
ATTRIBUTES = {
    "town": ["town of"],
    "work": ["works as"],
    "born": ["born in"],
    "pet": ["pet is"],
}


@dataclass
class Prompt:
    """One document set: its chunk tokens, full attention's KV and sentences."""

    tokens: list[int]
    lengths: list[int]  # system prompt, then documents
    full: KV
    texts: list[str]  # each token's text
    sentences: list[tuple[int, int]] = field(default_factory=list)
    bases: dict[str, KV] = field(default_factory=dict)

    @property
    def starts(self) -> list[int]:
        return [sum(self.lengths[:i]) for i in range(len(self.lengths))]

    @property
    def end(self) -> int:
        return sum(self.lengths)

    @property
    def body(self) -> int:
        return self.end - self.lengths[0]

    def chunks(self) -> list[tuple[int, int]]:
        """(start, length) of every chunk after the system prompt."""
        return list(zip(self.starts[1:], self.lengths[1:], strict=True))


def kv_of(cache: DynamicCache) -> KV:
    return [(layer.keys, layer.values) for layer in cache.layers]


@torch.no_grad()
def forward(model, ids: list[int], start: int, cache=None, mask=None) -> DynamicCache:
    cache = DynamicCache() if cache is None else cache
    model(
        input_ids=torch.tensor([ids]),
        position_ids=torch.arange(start, start + len(ids))[None],
        attention_mask=mask,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,  # only the last position's are read
    )
    return cache


def prepare(model, tokenizer, segments: list[list[int]]) -> Prompt:
    head = segments[:-1]
    tokens = [t for s in head for t in s]
    texts = [tokenizer.decode([t]) for t in tokens]
    prompt = Prompt(
        tokens, [len(s) for s in head], kv_of(forward(model, tokens, 0)), texts
    )
    for start, length in prompt.chunks():
        first = start
        for pos in range(start, start + length):
            if texts[pos].rstrip().endswith(".") or pos == start + length - 1:
                prompt.sentences.append((first, pos + 1))
                first = pos + 1
    return prompt


def base_kv(model, prompt: Prompt, context: list[int]) -> KV:
    """Every chunk computed after ``context`` at its actual positions (the
    system prompt as itself): what the store holds, re-rotated."""
    system = prompt.lengths[0]
    parts = [[(k[:, :, :system], v[:, :, :system]) for k, v in prompt.full]]
    for start, length in prompt.chunks():
        ids = context + prompt.tokens[start : start + length]
        kv = kv_of(forward(model, ids, start - len(context)))
        parts.append(
            [(k[:, :, len(context) :], v[:, :, len(context) :]) for k, v in kv]
        )
    return [
        (torch.cat([p[n][0] for p in parts], 2), torch.cat([p[n][1] for p in parts], 2))
        for n in range(len(prompt.full))
    ]


def recompute(model, prompt: Prompt, base: KV, positions: list[int]) -> KV:
    """``base`` with ``positions`` recomputed in one pass, each attending
    causally to every earlier position (loaded or recomputed)."""
    if not positions:
        return base
    chosen = torch.tensor(positions)
    loaded = torch.ones(prompt.end, dtype=torch.bool)
    loaded[chosen] = False
    kept = torch.nonzero(loaded)[:, 0]
    cache = DynamicCache()
    for number, (k, v) in enumerate(base):
        cache.update(k[:, :, kept], v[:, :, kept], number)
    query = chosen[:, None]
    allowed = torch.cat([kept[None, :] < query, chosen[None, :] <= query], 1)
    mask = torch.zeros(allowed.shape).masked_fill(
        ~allowed, torch.finfo(torch.float32).min
    )
    model(
        input_ids=torch.tensor([[prompt.tokens[p] for p in positions]]),
        position_ids=chosen[None],
        attention_mask=mask[None, None],
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,  # only the last position's are read
    )
    order = torch.argsort(torch.cat([kept, chosen]))
    return [(k[:, :, order], v[:, :, order]) for k, v in kv_of(cache)]


@torch.no_grad()
def answer(model, tokenizer, kv: KV, at: int, question: list[int]) -> str:
    cache = DynamicCache()
    for number, (k, v) in enumerate(kv):
        cache.update(k.clone(), v.clone(), number)
    feed, out = question, []
    for _ in range(8):
        logits = model(
            input_ids=torch.tensor([feed]),
            position_ids=torch.arange(at, at + len(feed))[None],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,  # only the last position's are read
        ).logits[0, -1]
        at += len(feed)
        feed = [int(logits.argmax())]
        out.append(feed[0])
        if "\n" in tokenizer.decode(out):
            break
    return tokenizer.decode(out).split("\n")[0]


# -- which tokens ---------------------------------------------------------------


def sentences_with(prompt: Prompt, phrases: list[str]) -> set[int]:
    out: set[int] = set()
    for first, stop in prompt.sentences:
        text = "".join(prompt.texts[first:stop]).lower()
        if any(phrase in text for phrase in phrases):
            out.update(range(first, stop))
    return out


def deviating(prompt: Prompt, base: KV, share: float, layers: list[int]) -> set[int]:
    """The ``share`` of chunk tokens whose keys and values at ``layers``
    differ most from full attention's (summed L2 norms over heads)."""
    deviation = torch.zeros(prompt.end)
    for n in layers:
        (fk, fv), (bk, bv) = prompt.full[n], base[n]
        deviation += (fk - bk).norm(dim=-1).sum(1)[0] + (fv - bv).norm(dim=-1).sum(1)[0]
    deviation[: prompt.lengths[0]] = -1
    return set(torch.topk(deviation, round(share * prompt.body)).indices.tolist())


def positions(mode: str, prompt: Prompt, base: KV, question: str) -> list[int]:
    """The chunk positions ``mode`` recomputes, sorted."""
    chosen: set[int] = set()
    for part in mode.split("+"):
        kind, _, arg = part.partition(":")
        if kind == "head":
            for start, length in prompt.chunks():
                chosen.update(range(start, start + min(int(arg), length)))
        elif kind == "tail":
            chosen.update(
                range(prompt.end - round(float(arg) * prompt.body), prompt.end)
            )
        elif kind == "dev":
            share, _, at = arg.partition("@")
            layers = (
                range(len(prompt.full))
                if at in ("", "all")
                else map(int, at.split(","))
            )
            chosen |= deviating(prompt, base, float(share), list(layers))
        elif kind == "attr":
            asked = [k for k in ATTRIBUTES if k in question.lower()][:1]
            chosen |= sentences_with(prompt, [p for k in asked for p in ATTRIBUTES[k]])
        elif kind == "facts":
            chosen |= sentences_with(
                prompt, [p for v in ATTRIBUTES.values() for p in v]
            )
        elif kind == "names":
            chosen |= sentences_with(prompt, ["profile of"])
        elif kind not in ("isolated", "base", "kscale"):
            raise ValueError(f"unknown mode part {part!r}")
    return sorted(chosen)


class Contexts:
    """The fill contexts a mode may name (``base:NAME``)."""

    def __init__(self, prompts: Prompts) -> None:
        rng = random.Random(7)
        others = People(seed=12345).group(3)  # not among the benchmark's people
        self.documents = [prompts.document(p, rng, 500) for p in others]
        self.neutral = prompts.encode(NEUTRAL + "\n\n")

    def tokens(self, name: str, system: list[int]) -> list[int]:
        if name == "system":
            return system
        if name == "generic":
            return system + self.neutral
        if name.startswith("bridge"):
            count = int(name[len("bridge") :] or 1)
            return system + [t for d in self.documents[:count] for t in d]
        raise ValueError(f"unknown fill context {name!r}")


def loaded_kv(model, prompt: Prompt, mode: str, contexts: Contexts) -> KV:
    """What a mode loads: chunks after its fill context, keys scaled."""
    parts = dict(p.partition(":")[::2] for p in mode.split("+"))
    name = parts.get("base", "isolated")
    if name not in prompt.bases:
        system = prompt.tokens[: prompt.lengths[0]]
        context = [] if name == "isolated" else contexts.tokens(name, system)
        prompt.bases[name] = base_kv(model, prompt, context)
    base = prompt.bases[name]
    if "kscale" in parts:
        scale, system = float(parts["kscale"]), prompt.lengths[0]
        base = [(torch.cat([k[:, :, :system], k[:, :, system:] * scale], 2), v)
                for k, v in base]  # fmt: skip
    return base


def run_set(model, tokenizer, items, modes, contexts, results, number) -> None:
    """Answers every question of one document set in every mode not yet in
    ``results`` (mode -> question id -> [right, recomputed share, text])."""
    prompt = prepare(model, tokenizer, items[0].segments)
    for mode in modes:
        done = results.setdefault(mode, {})
        cached: tuple[KV, float] | None = None
        for index, item in enumerate(items):
            key = f"{number}.{index}"
            if key in done:
                continue
            question = tokenizer.decode(item.segments[-1])
            if mode == "full":
                kv, share = prompt.full, 1.0
            elif cached is None or "attr" in mode:  # attr depends on the question
                base = loaded_kv(model, prompt, mode, contexts)
                chosen = positions(mode, prompt, base, question)
                kv, share = (
                    recompute(model, prompt, base, chosen),
                    len(chosen) / prompt.body,
                )
                cached = kv, share
            else:
                kv, share = cached
            text = answer(model, tokenizer, kv, prompt.end, item.segments[-1])
            done[key] = [item.expected.lower() in text.lower(), share, text]


def report(results: dict, modes: list[str]) -> None:
    full = results.get("full", {})
    print("| mode | right | recomputed | vs full attention (paired, 95%) |")
    print("|---|---|---|---|")
    for mode in modes:
        done = results.get(mode, {})
        keys = sorted(done)
        if not keys:
            continue
        right = sum(done[k][0] for k in keys)
        share = statistics.mean(done[k][1] for k in keys)
        paired = [int(done[k][0]) - int(full[k][0]) for k in keys if k in full]
        diff = "-"
        if mode != "full" and len(paired) > 1:
            half = 1.96 * statistics.stdev(paired) / math.sqrt(len(paired))
            diff = f"{statistics.mean(paired):+.1%} ± {half:.1%}"
        print(f"| {mode} | {right}/{len(keys)} ({right / len(keys):.1%}) "
              f"| {share:.1%} | {diff} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/smollm2")
    parser.add_argument("--sets", type=int, default=12)
    parser.add_argument("--modes", nargs="+", default=["full", "isolated"])
    parser.add_argument("--results", help="JSON: answers kept, runs resumed")
    parser.add_argument(
        "--generator",
        choices=GENERATORS,
        default="profiles",
        help="the documents (reuse_workload.py's kinds)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the documents' seed")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    prompts = Prompts(args.model)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    # chunk_quality.py's sets (its defaults: profiles, seed 0), one-document
    # questions only
    options = argparse.Namespace(sets=args.sets, docs=4, doc_tokens=500, per_set=8,
                                 two_hop=2)  # fmt: skip
    sets = [
        [item for item in items if not item.two_hop]
        for items in accuracy_items(
            prompts, GENERATORS[args.generator](args.seed), options
        )
    ]
    saved = Path(args.results) if args.results else None
    results = json.loads(saved.read_text()) if saved and saved.exists() else {}
    contexts = Contexts(prompts)
    for number, items in enumerate(sets):
        run_set(model, prompts.tokenizer, items, args.modes, contexts, results, number)
        if saved is not None:
            saved.write_text(json.dumps(results))
        print(f"set {number + 1}/{len(sets)} done", flush=True)
    report(results, args.modes)


if __name__ == "__main__":
    main()
