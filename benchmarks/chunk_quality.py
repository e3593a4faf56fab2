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
(``joint``: the prompt as one sequence, stored chunks moved and new ones
computed in place; ``paths``: each document on its own prefix), each
choosing its recomputed tokens per request with the `chunk_recompute` field. Per mode:

- accuracy on one-document questions with a Wilson 95% interval, and the
  paired difference against plain vLLM with its 95% interval; accuracy on
  two-document questions. The first question of every set goes first (it
  computes the documents), then the others, which find them warm;
- warm TTFT on 4 profiles of about 1,000 tokens: sent once (cold), then in
  other orders with other questions (warm: every chunk stored; plain vLLM
  recomputes all but the system prompt), timed to the first token, and its
  ratio to plain vLLM's on the same prompts.

Two workloads (``--workload``): ``fixed`` (above: each set's documents in one
order, first sight and warm alike) and ``reuse`` (benchmarks/reuse_workload.py:
a pool of 8 documents a set, each first seen in one of two prompts of 4, then
warm prompts of 4 of the pool in new combinations and orders, never after a
neighbour a chunk was computed with; one question per document of every
prompt). On ``reuse`` the table gives first-sight and warm accuracy apart,
each paired against plain vLLM (the interval also clustered by prompt), and
both TTFTs, each mode timed on a pool of 4 x ``--ttft-doc-tokens`` documents
of its own (so its first sight is one). Two document kinds
(``--generator``): the profiles, and data sheets of made-up products
(benchmarks/quality_sheets.py: named once, facts by "it"/"the unit"), and
controlled variants of both.

Modes are a table (``MODES``: name -> server, ``chunk_recompute``; ``SERVERS``:
name -> `vllm serve` flags), extended from the command line without editing:
``--server NAME="FLAGS"`` and ``--mode NAME=SERVER:FIELD`` (FIELD: JSON, or
``default``/``none``).

    .venv/bin/python benchmarks/chunk_quality.py [--plot docs/chunk_quality.svg]
    .venv/bin/python benchmarks/chunk_quality.py --workload reuse \
        --generator sheets --sets 20 --results /tmp/reuse_sheets.json \
        --mode "head 64=joint:{\"head\": 64}" --modes plain default paths "head 64"
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import shlex
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import quality_report
from reuse_workload import GENERATORS, phases, reuse_sets, ttft_pool  # on sys.path
from transformers import AutoTokenizer

from vllm_kvreuse.testing.server import SERVED_MODEL, Server, ServerSettings

SYSTEM = "Answer the question from the documents. Reply with the answer only."

# Server groups: one `vllm serve` each ("plain": no chunk cache).
SERVERS: dict[str, list[str]] = {
    "plain": [],
    "joint": ["--enable-chunk-cache"],
    "paths": ["--enable-chunk-cache", "--chunk-attention", "paths"],
}
# mode: (server, the request's chunk_recompute field; None for plain vLLM,
# "default" to send none: the server's defaults)
MODES: dict[str, tuple[str, Any]] = {
    "plain": ("plain", None),
    "default": ("joint", "default"),
    # stored chunks moved, nothing recomputed (new chunks: in place)
    "in place": ("joint", "none"),
    "tail 0.25+head 32": ("joint", {"tail": 0.25, "head": 32}),
    "tail 0.25": ("joint", {"tail": 0.25}),
    "head 128": ("joint", {"head": 128}),
    "select 0.25+head 32": ("joint", {"select": 0.25, "head": 32}),
    # per-document answer paths in the engine (--chunk-attention paths)
    "paths": ("paths", "default"),
}


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

    def document(self, subject: Any, rng: random.Random, tokens: int) -> list[int]:
        """``subject``'s document (a profile, a data sheet), about ``tokens``
        tokens long."""
        return self.encode(self.document_text(subject, rng, tokens))

    def document_text(self, subject: Any, rng: random.Random, tokens: int) -> str:
        sentences = max(1, tokens // 14)
        text = subject.profile(rng, sentences)
        while len(self.encode(text + "\n\n")) < tokens * 0.95:
            sentences += 2
            text = subject.profile(rng, sentences)
        return text + "\n\n"

    def question(self, question: str, lead: str) -> list[int]:
        return self.encode(f"Question: {question}{self.tail}{lead}")


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
    two_hop: bool = False  # a two-document question
    warm: bool = False  # reuse: a question on a warm prompt
    prompt: str = ""  # "SET.cN"/"SET.wN": its prompt (first sight, warm)
    docs: tuple[int, ...] = ()  # reuse: the pool's documents, in order
    asked: int = -1  # reuse: the pool document asked about (first named)
    also: str = ""  # a second value the answer must name (pair questions)
    rivals: tuple[str, ...] = ()  # values that make an answer wrong
    max_tokens: int = 8


def is_right(item: Item, text: str) -> bool:
    """Whether ``text`` answers ``item``: it names the expected value (and
    ``also``, in either order) and none of its rivals (case-insensitive)."""
    text = text.lower()
    wanted = [item.expected, *([item.also] if item.also else [])]
    return all(v.lower() in text for v in wanted) and not any(
        r.lower() in text for r in item.rivals
    )


def accuracy_items(
    prompts: Prompts, people: Any, args: argparse.Namespace
) -> list[list[Item]]:
    """``args.sets`` document sets of ``args.docs`` documents of ``people``
    (a generator: profiles, data sheets), each asked ``args.per_set``
    one-document questions and ``args.two_hop`` two-document ones (a best
    friend's town; none where the documents name no one)."""
    rng = random.Random(1)
    out = []
    for number in range(args.sets):
        persons = people.group(args.docs)
        head = [
            prompts.system,
            *(prompts.document(p, rng, args.doc_tokens) for p in persons),
        ]
        one = rng.sample([q for p in persons for q in p.questions()], args.per_set)
        hops = [p.two_hop() for p in persons if p.friend is not None]
        two = rng.sample(hops, min(args.two_hop, len(hops)))
        at = f"{number}.c0"
        out.append(
            [Item([*head, prompts.question(q, lead)], a, prompt=at)
             for q, lead, a in one]
            + [Item([*head, prompts.question(q, lead)], a, True, prompt=at)
               for q, lead, a in two]
        )  # fmt: skip
    return out


def ttft_prompts(
    prompts: Prompts, people: Any, doc_tokens: int, warm: int
) -> tuple[list[Item], list[Item]]:
    """Fixed: the cold prompt (4 documents of about ``doc_tokens`` tokens)
    and ``warm`` prompts with the same documents in other orders."""
    rng = random.Random(2)
    persons = people.group(4)
    documents = [prompts.document(p, rng, doc_tokens) for p in persons]
    orders = list(itertools.permutations(range(4)))[1:]
    items = []
    for order in rng.sample(orders, warm + 1):
        question, lead, answer = rng.choice(rng.choice(persons).questions())
        segments = [prompts.system, *(documents[i] for i in order)]
        items.append(Item([*segments, prompts.question(question, lead)], answer))
    return [Item(items[0].segments, "")], items[1:]


def run_mode(
    client: httpx.Client,
    recompute: Any,
    items: list[Item],
    timed: tuple[list[Item], list[Item]],
    concurrency: int,
    reuse: bool,
) -> list:
    """[right or wrong per item, in ``items`` order; warm TTFTs], and on
    ``reuse`` the first-sight TTFTs too."""
    chunked = recompute is not None
    right: dict[int, bool] = {}
    with ThreadPoolExecutor(concurrency) as pool:
        for phase in phases(items):
            texts = pool.map(
                lambda item: complete(client, item, chunked, recompute,
                                      item.max_tokens)[0], phase,
            )  # fmt: skip
            for item, text in zip(phase, texts, strict=True):
                right[id(item)] = is_right(item, text)
    cold, warm = timed
    # Fixed: the accuracy phase may have evicted the warm documents from the
    # store: the cold prompt brings them back first, so every timed prompt is
    # warm. Reuse: the mode's own pool, a first sight, timed.
    cold_ttfts = [complete(client, item, chunked, recompute, 1)[1] for item in cold]
    ttfts = [complete(client, item, chunked, recompute, 1)[1] for item in warm]
    out = [[right[id(item)] for item in items], ttfts]
    return [*out, cold_ttfts] if reuse else out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/smollm2")
    parser.add_argument("--modes", nargs="+", help="default: every mode")
    parser.add_argument("--workload", choices=("fixed", "reuse"), default="fixed")
    parser.add_argument("--generator", choices=GENERATORS, default="profiles")
    parser.add_argument("--sets", type=int, help="document sets (40 fixed, 20 reuse)")
    parser.add_argument("--docs", type=int, default=4, help="documents per prompt")
    parser.add_argument("--doc-tokens", type=int, default=500)
    parser.add_argument("--per-set", type=int, default=8, help="fixed: one-document q")
    parser.add_argument("--two-hop", type=int, default=2, help="fixed: two-document q")
    parser.add_argument("--pool", type=int, default=8, help="reuse: documents a set")
    parser.add_argument("--warm-prompts", type=int, default=4, help="reuse: per set")
    parser.add_argument(
        "--per-doc",
        type=int,
        default=1,
        help="reuse: one-document questions per document",
    )
    parser.add_argument(
        "--pairs",
        action="store_true",
        help="reuse: also two-document questions (neighbours)",
    )
    parser.add_argument("--seed", type=int, default=0, help="reuse: other pools")
    parser.add_argument("--ttft-doc-tokens", type=int, default=1000)
    parser.add_argument("--warm", type=int, default=3, help="timed warm prompts")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--plot", help="write the trade-off plot (SVG) here")
    parser.add_argument(
        "--results", help="JSON file: modes found there are not run again; "
        "each mode's answers and TTFTs are added as it ends",
    )  # fmt: skip
    parser.add_argument(
        "--server",
        action="append",
        default=[],
        metavar='NAME="FLAGS"',
        help="add a server group",
    )
    parser.add_argument("--mode", action="append", default=[],
                        metavar="NAME=SERVER:FIELD", help="add a mode")  # fmt: skip
    ServerSettings.add_arguments(parser)
    args = parser.parse_args()
    for spec in args.server:
        name, _, flags = spec.partition("=")
        SERVERS[name] = shlex.split(flags)
    for spec in args.mode:
        name, _, rest = spec.partition("=")
        server, _, field = rest.partition(":")
        if server not in SERVERS:
            parser.error(f"--mode {spec}: no server {server!r}")
        named = field in ("default", "none")
        MODES[name] = (server, field if named else json.loads(field))
    args.modes = args.modes or list(MODES)
    if unknown := [m for m in args.modes if m not in MODES]:
        parser.error(f"unknown modes {unknown}; known: {list(MODES)}")
    args.sets = args.sets or (40 if args.workload == "fixed" else 20)
    return args


def load_results(saved: Path | None, meta: dict) -> dict[str, list]:
    """The results kept in ``saved``, refused if a run of another workload."""
    if saved is None or not saved.exists():
        return {}
    results = json.loads(saved.read_text())
    if results.pop("_args", meta) != meta:
        raise SystemExit(f"{saved} holds another workload's results")
    return results


def main() -> None:
    args = parse_args()
    settings = ServerSettings.from_args(args)
    reuse = args.workload == "reuse"
    prompts = Prompts(args.model)
    people = GENERATORS[args.generator](args.seed)
    if reuse:
        items = [i for s in reuse_sets(prompts, people, args, Item) for i in s.items]
    else:
        items = [i for s in accuracy_items(prompts, people, args) for i in s]
        fixed_timed = ttft_prompts(prompts, people, args.ttft_doc_tokens, args.warm)
    context = statistics.mean(sum(map(len, i.segments[:-1])) for i in items)
    print(
        f"model {args.model}, {args.workload} workload of {args.generator}: "
        f"{len(items)} questions ({sum(i.warm for i in items)} warm) over "
        f"{args.sets} sets (~{context:.0f} context tokens a prompt)",
        flush=True,
    )
    logs = Path(tempfile.mkdtemp())
    common = ["--max-model-len", "8192", "--max-num-batched-tokens", "8192"]
    saved = Path(args.results) if args.results else None
    meta = {
        k: getattr(args, k)
        for k in (
            "workload",
            "generator",
            "sets",
            "docs",
            "doc_tokens",
            "pool",
            "warm_prompts",
        )
    }
    # Left out at their defaults, so the results of runs before them still load.
    defaults = {"per_doc": 1, "pairs": False, "seed": 0}
    meta.update({k: getattr(args, k) for k, d in defaults.items()
                 if getattr(args, k) != d})  # fmt: skip
    results = load_results(saved, meta)
    for server_name, flags in SERVERS.items():
        modes = [
            m for m in args.modes if MODES[m][0] == server_name and m not in results
        ]
        if not modes:
            continue
        extra = [*flags, "--chunk-cache-device-fraction", "0.5"] if flags else []
        with (
            Server(
                args.model, *common, *extra,
                log_path=logs / f"{server_name}.log", settings=settings,
                # CPU: 4 GiB unless --kv-cache-gib (ServerSettings) says.
                env={"VLLM_CPU_KVCACHE_SPACE": f"{args.kv_cache_gib or 4:g}"},
            ) as server,
            httpx.Client(base_url=server.url, timeout=1800) as client,
        ):  # fmt: skip
            for mode in modes:
                started = time.perf_counter()
                timed = (
                    ttft_pool(prompts, GENERATORS[args.generator], mode, args, Item)
                    if reuse
                    else fixed_timed
                )
                results[mode] = run_mode(
                    client, MODES[mode][1], items, timed, args.concurrency, reuse
                )
                if saved is not None:
                    saved.write_text(json.dumps({"_args": meta, **results}))
                right, ttfts, *cold = results[mode]
                print(
                    f"{mode}: {sum(right)}/{len(right)} right "
                    f"({time.perf_counter() - started:.0f} s), warm TTFT "
                    f"{[round(t * 1e3) for t in ttfts]} ms"
                    + (f", first sight {[round(t * 1e3) for t in cold[0]]} ms"
                       if cold else ""),
                    flush=True,
                )  # fmt: skip
    chosen = {m: results[m] for m in args.modes if m in results}
    if reuse:
        points = quality_report.reuse_table(
            chosen, [i.warm for i in items], [i.prompt for i in items]
        )
    else:
        points = quality_report.fixed_table(chosen, [i.two_hop for i in items])
    if args.plot:
        quality_report.plot(points, args.plot, "warm" if reuse else "one document")


if __name__ == "__main__":
    main()
