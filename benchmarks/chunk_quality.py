"""Answer quality of the chunk cache's modes on a real model, against speed.

Question answering over several documents per prompt, with answers the model
cannot know: each document is the ~500-token profile of a fictional person
(benchmarks/quality_data.py: name first, facts among narrative sentences,
some by pronoun), four per prompt, in the model's chat template. A question
asks one attribute of one person, or (two-document questions) the town of a
person's best friend, named in that person's profile. The assistant turn
starts with the answer's lead ("Anna Vorn lives in the town of"), so a small
model answers in a few tokens; an answer is right when the 8 greedy tokens
after it contain the expected value (case-insensitive).

Modes are paired: every mode answers the same token ids. Plain vLLM (full
attention, prefix caching on, the prompt as one token list) runs on its own
`vllm serve`; the chunk-cache modes run on one server per attention setting
(isolated, system), each choosing its recomputed tokens per request with the
`chunk_recompute` field. Per mode:

- accuracy on one-document questions with a Wilson 95% interval, and the
  paired difference against plain vLLM with its 95% interval; accuracy on
  two-document questions. The first question of every set goes first (it
  computes the documents), then the others, which find them warm;
- warm TTFT on 4 profiles of about 1,000 tokens: sent once (cold), then in
  other orders with other questions (warm: every chunk stored; plain vLLM
  recomputes all but the system prompt), timed to the first token, and its
  ratio to plain vLLM's on the same prompts.

    .venv/bin/python benchmarks/chunk_quality.py [--plot docs/chunk_quality.svg]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from quality_data import People, Person  # benchmarks/ is on sys.path when run
from transformers import AutoTokenizer

from vllm_kvreuse.testing.server import SERVED_MODEL, Server, ServerSettings

SYSTEM = "Answer the question from the documents. Reply with the answer only."

# Server groups: one `vllm serve` each ("plain": no chunk cache).
SERVERS = {
    "plain": [],
    "isolated": ["--enable-chunk-cache", "--chunk-attention", "isolated"],
    "system": ["--enable-chunk-cache", "--chunk-attention", "system"],
    # chunks computed after the system prompt and one other profile (of
    # people from another seed): --chunk-fill-context, FILE added in main()
    "context": ["--enable-chunk-cache", "--chunk-attention", "system"],
}
# mode: (server, the request's chunk_recompute field; None for plain vLLM,
# "default" to send none: the server's defaults)
MODES: dict[str, tuple[str, Any]] = {
    "plain": ("plain", None),
    "default": ("isolated", "default"),
    "isolated": ("isolated", "none"),
    "system": ("system", "none"),
    "tail 0.25": ("isolated", {"tail": 0.25}),
    "tail 0.5": ("isolated", {"tail": 0.5}),
    "head 8": ("isolated", {"head": 8}),
    "head 32": ("isolated", {"head": 32}),
    "system+head 32": ("system", {"head": 32}),
    "select 0.25": ("isolated", {"select": 0.25}),
    "select 0.25+head 32": ("isolated", {"select": 0.25, "head": 32}),
    "select 0.5": ("isolated", {"select": 0.5}),
    "tail 0.25+head 32": ("isolated", {"tail": 0.25, "head": 32}),
    "head 64": ("isolated", {"head": 64}),
    "tail 0.125+head 32": ("isolated", {"tail": 0.125, "head": 32}),
    "tail 0.2+head 32": ("isolated", {"tail": 0.2, "head": 32}),
    "tail 0.125+head 64": ("isolated", {"tail": 0.125, "head": 64}),
    "head 128": ("isolated", {"head": 128}),
    "system+select 0.25": ("system", {"select": 0.25}),
    "context": ("context", "none"),
    "context+default": ("context", "default"),
    "context+tail 0.25+head 32": ("context", {"tail": 0.25, "head": 32}),
}


def fill_context(prompts: Prompts, path: Path) -> Path:
    """One profile of a person from another seed (none of the benchmark's
    people), written to ``path``: the documents' kind, none of their facts."""
    person = People(seed=12345).group(3)[0]  # chunk_recompute_reference's "bridge1"
    path.write_text(prompts.document_text(person, random.Random(7), 500))
    return path


class Prompts:
    """Token segments in the model's chat template: the system turn up to
    the user's text, one per document, and the question closing the user
    turn and opening the assistant's with the answer's lead."""

    def __init__(self, model: str) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        marker = "\x00USER\x00"
        text = self.tokenizer.apply_chat_template(
            [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": marker},
            ],
            tokenize=False,
            add_generation_prompt=True,
        )
        self.head, self.tail = text.split(marker)
        self.system = self.encode(self.head)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def document(self, person: Person, rng: random.Random, tokens: int) -> list[int]:
        """``person``'s profile, about ``tokens`` tokens long."""
        return self.encode(self.document_text(person, rng, tokens))

    def document_text(self, person: Person, rng: random.Random, tokens: int) -> str:
        sentences = max(1, tokens // 14)
        text = person.profile(rng, sentences)
        while len(self.encode(text + "\n\n")) < tokens * 0.95:
            sentences += 2
            text = person.profile(rng, sentences)
        return text + "\n\n"

    def question(self, question: str, lead: str) -> list[int]:
        return self.encode(f"Question: {question}{self.tail}{lead}")


def wilson(right: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion (95% for z = 1.96)."""
    if not total:
        return 0.0, 1.0
    p = right / total
    scale = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / scale
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total**2)) / scale
    return max(0.0, centre - half), min(1.0, centre + half)


def complete(
    client: httpx.Client, item: Item, chunked: bool, recompute: Any, max_tokens: int
) -> tuple[str, float]:
    """(text, seconds) of a greedy completion of the item's segments."""
    body: dict = {"model": SERVED_MODEL, "max_tokens": max_tokens, "temperature": 0}
    body["stop"] = ["\n"]
    if chunked:
        body["chunks"] = item.segments
        if recompute != "default":
            body["chunk_recompute"] = recompute
    else:
        body["prompt"] = [token for segment in item.segments for token in segment]
    start = time.perf_counter()
    response = client.post("/v1/completions", json=body)
    elapsed = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"{response.status_code}: {response.text}")
    return response.json()["choices"][0]["text"], elapsed


@dataclass(frozen=True, slots=True)
class Item:
    segments: list[list[int]]
    expected: str
    two_hop: bool = False


def accuracy_items(
    prompts: Prompts, people: People, args: argparse.Namespace
) -> list[list[Item]]:
    """``args.sets`` document sets of ``args.docs`` profiles, each asked
    ``args.questions_per_set`` one-document questions and ``args.two_hop``
    two-document ones (a best friend's town)."""
    rng = random.Random(1)
    out = []
    for _ in range(args.sets):
        persons = people.group(args.docs)
        head = [
            prompts.system,
            *(prompts.document(p, rng, args.doc_tokens) for p in persons),
        ]
        one = rng.sample([q for p in persons for q in p.questions()], args.per_set)
        two = rng.sample([p.two_hop() for p in persons], args.two_hop)
        out.append(
            [Item([*head, prompts.question(q, lead)], a) for q, lead, a in one]
            + [Item([*head, prompts.question(q, lead)], a, True) for q, lead, a in two]
        )
    return out


def ttft_prompts(
    prompts: Prompts, people: People, doc_tokens: int, warm: int
) -> tuple[list[list[int]], list[Item]]:
    """The cold prompt (4 profiles of about ``doc_tokens`` tokens) and
    ``warm`` prompts with the same documents in other orders."""
    rng = random.Random(2)
    persons = people.group(4)
    documents = [prompts.document(p, rng, doc_tokens) for p in persons]
    orders = list(itertools.permutations(range(4)))[1:]
    items = []
    for order in rng.sample(orders, warm + 1):
        question, lead, answer = rng.choice(rng.choice(persons).questions())
        segments = [prompts.system, *(documents[i] for i in order)]
        items.append(Item([*segments, prompts.question(question, lead)], answer))
    return items[0].segments, items[1:]


def run_mode(
    client: httpx.Client,
    recompute: Any,
    sets: list[list[Item]],
    cold: list[list[int]],
    warm: list[Item],
    concurrency: int,
) -> tuple[list[bool], list[float]]:
    """(right or wrong per item, in ``sets`` order; warm TTFTs)."""
    chunked = recompute is not None
    right: dict[int, bool] = {}
    with ThreadPoolExecutor(concurrency) as pool:
        items = [item for s in sets for item in s]
        first = {id(s[0]) for s in sets}  # computes the documents: goes first
        for phase in ([i for i in items if id(i) in first],
                      [i for i in items if id(i) not in first]):  # fmt: skip
            texts = pool.map(
                lambda item: complete(client, item, chunked, recompute, 8)[0], phase
            )
            for item, text in zip(phase, texts, strict=True):
                right[id(item)] = item.expected.lower() in text.lower()
    # The accuracy phase may have evicted the warm documents from the store:
    # the cold prompt brings them back first, so every timed prompt is warm.
    complete(client, Item(cold, ""), chunked, recompute, 1)
    ttfts = [complete(client, item, chunked, recompute, 1)[1] for item in warm]
    return [right[id(item)] for item in items], ttfts


def paired(mode: list[bool], plain: list[bool]) -> tuple[float, float]:
    """Mean paired difference (mode - plain) and its 95% half-width."""
    diffs = [int(m) - int(p) for m, p in zip(mode, plain, strict=True)]
    mean = statistics.mean(diffs)
    half = (
        1.96 * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0
    )
    return mean, half


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/smollm2")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--sets", type=int, default=40, help="document sets")
    parser.add_argument("--docs", type=int, default=4, help="profiles per set")
    parser.add_argument("--doc-tokens", type=int, default=500)
    parser.add_argument("--per-set", type=int, default=8, help="one-document questions")
    parser.add_argument("--two-hop", type=int, default=2, help="two-document questions")
    parser.add_argument("--ttft-doc-tokens", type=int, default=1000)
    parser.add_argument("--warm", type=int, default=3, help="timed warm prompts")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--kv-cache-gib", default="4")
    parser.add_argument("--plot", help="write the trade-off plot (SVG) here")
    parser.add_argument(
        "--results", help="JSON file: modes found there are not run again; "
        "each mode's answers and TTFTs are added as it ends",
    )  # fmt: skip
    ServerSettings.add_arguments(parser)
    args = parser.parse_args()
    settings = ServerSettings.from_args(args)

    prompts = Prompts(args.model)
    people = People(seed=0)
    sets = accuracy_items(prompts, people, args)
    cold, warm = ttft_prompts(prompts, people, args.ttft_doc_tokens, args.warm)
    context = statistics.mean(sum(map(len, s[0].segments[:-1])) for s in sets)
    print(
        f"model {args.model}: {sum(map(len, sets))} questions over {len(sets)} sets "
        f"of {args.docs} profiles (~{context:.0f} context tokens); TTFT on "
        f"{len(cold)} segments, {sum(map(len, cold))} tokens, {len(warm)} warm",
        flush=True,
    )
    logs = Path(tempfile.mkdtemp())
    common = ["--max-model-len", "8192", "--max-num-batched-tokens", "8192"]
    saved = Path(args.results) if args.results else None
    results: dict[str, tuple[list[bool], list[float]]] = {}
    if saved is not None and saved.exists():
        results = {m: tuple(r) for m, r in json.loads(saved.read_text()).items()}
    for server_name, flags in SERVERS.items():
        modes = [
            m for m in args.modes if MODES[m][0] == server_name and m not in results
        ]
        if not modes:
            continue
        extra = [*flags, "--chunk-cache-device-fraction", "0.5"] if flags else []
        if server_name == "context":
            extra += ["--chunk-fill-context", str(fill_context(prompts, logs / "ctx"))]
        with (
            Server(
                args.model, *common, *extra,
                log_path=logs / f"{server_name}.log", settings=settings,
                env={"VLLM_CPU_KVCACHE_SPACE": args.kv_cache_gib},
            ) as server,
            httpx.Client(base_url=server.url, timeout=1800) as client,
        ):  # fmt: skip
            for mode in modes:
                started = time.perf_counter()
                results[mode] = run_mode(
                    client, MODES[mode][1], sets, cold, warm, args.concurrency
                )
                if saved is not None:
                    saved.write_text(json.dumps(results))
                right, ttfts = results[mode]
                print(
                    f"{mode}: {sum(right)}/{len(right)} right "
                    f"({time.perf_counter() - started:.0f} s), warm TTFT "
                    f"{[round(t * 1e3) for t in ttfts]} ms",
                    flush=True,
                )
    chosen = {m: results[m] for m in args.modes if m in results}
    report(chosen, [item.two_hop for s in sets for item in s], args.plot)


def report(
    results: dict[str, tuple[list[bool], list[float]]],
    two_hop: list[bool],
    plot: str | None,
) -> None:
    """The trade-off table (and plot): accuracy, paired difference against
    plain vLLM with its 95% interval, warm TTFT and its ratio to plain's."""
    plain = results.get("plain")
    plain_ttft = statistics.median(plain[1]) if plain else 0.0
    print(
        "\n| mode | accuracy, one document (Wilson 95%) | vs full attention "
        "(paired, 95%) | two documents | warm TTFT p50 | plain / mode |"
    )
    print("|---|---|---|---|---|---|")
    points = {}
    for mode, (right, ttfts) in results.items():
        one = [r for r, two in zip(right, two_hop, strict=True) if not two]
        two = [r for r, two in zip(right, two_hop, strict=True) if two]
        low, high = wilson(sum(one), len(one))
        diff = "-"
        if plain and mode != "plain":
            plain_one = [r for r, t in zip(plain[0], two_hop, strict=True) if not t]
            mean, half = paired(one, plain_one)
            diff = f"{mean:+.1%} ± {half:.1%}"
        ttft = statistics.median(ttfts)
        ratio = plain_ttft / ttft if plain_ttft else 0.0
        print(
            f"| {mode} | {sum(one) / len(one):.1%} ({sum(one)}/{len(one)}, "
            f"{low:.1%}-{high:.1%}) | {diff} | "
            f"{sum(two) / max(len(two), 1):.1%} ({sum(two)}/{len(two)}) | "
            f"{ttft * 1e3:.0f} ms | {ratio:.2f}x |"
        )
        points[mode] = [(max(ratio, 1e-3), max(sum(one) / len(one), 1e-3))]
    if plot:
        from svg_plot import line_chart  # benchmarks/ is on sys.path when run

        line_chart(
            points, plot, "Chunk cache: answers against speed",
            "warm TTFT, plain vLLM / mode", "accuracy (one document)",
        )  # fmt: skip


if __name__ == "__main__":
    main()
