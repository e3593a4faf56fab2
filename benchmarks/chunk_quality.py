"""Answer quality of the chunk cache's attention modes on a real model.

Question answering over several documents per prompt, with answers the model
cannot know: each document is the record of a fictional person (seeded
names, towns, pets, jobs, birth years), and each question asks one attribute
of one person, in the model's chat template. The assistant turn starts with
the answer's lead ("Anna Vorn lives in the town of"), so a small model
answers in a few tokens; an answer counts as right when it contains the
expected value (case-insensitive).

Every mode runs on its own `vllm serve` of the same model, one after the
other, in one run: plain vLLM (full attention, prefix caching on, the prompt
sent as one token list) and each chunk-cache setting (the same tokens sent
as `chunks`: system prompt, documents, question). Per mode:

- accuracy with a Wilson 95% interval. Each document set is asked several
  questions; the first question of every set goes first (it computes the
  documents: fills, or plain vLLM's prefill), then the others, which find
  the documents warm (stored chunks, or plain vLLM's prefix cache: the
  question comes last, so the documents are an identical prefix);
- warm TTFT on 4 documents of about 1,000 tokens: the documents are sent
  once (cold), then in other orders with other questions (warm: every chunk
  stored; plain vLLM recomputes all but the system prompt), timed to the
  first token, and compared with plain vLLM on the same prompts.

    .venv/bin/python benchmarks/chunk_quality.py [--model models/smollm2]
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from vllm_kvreuse.testing.server import SERVED_MODEL, Server, ServerSettings

SYSTEM = "Answer the question from the documents. Reply with the answer only."


def words(text: str) -> list[str]:
    return text.split()


FIRST = words("Anna Tom Maria Peter Clara Hugo Lena Oscar Ida Felix Nora Victor")
JOBS = words(
    "baker sailor glassblower locksmith beekeeper cartographer potter "
    "blacksmith astronomer weaver carpenter violinist gardener tailor brewer "
    "jeweler surgeon miner librarian"
)
ONSETS = words("b br d dr f g gr k kr l m n p pr r s st t tr v z th sh")
VOWELS = words("a e i o u ai ou ei")
CODAS = ["", "", "n", "r", "l", "s", "th", "m", "k", "x"]
# name: default server arguments ("plain": no chunk cache)
MODES = {
    "plain": [],
    "isolated": ["--chunk-attention", "isolated"],
    "system": ["--chunk-attention", "system"],
    "isolated+recompute0.25": ["--chunk-recompute-fraction", "0.25"],
    "isolated+recompute0.5": ["--chunk-recompute-fraction", "0.5"],
    "system+recompute0.5": [
        "--chunk-attention",
        "system",
        "--chunk-recompute-fraction",
        "0.5",
    ],
}


def made_up_word(rng: random.Random, syllables: int) -> str:
    return "".join(
        rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)
        for _ in range(syllables)
    ).capitalize()


@dataclass(frozen=True, slots=True)
class Person:
    name: str
    town: str
    job: str
    year: str
    pet: str

    def record(self) -> str:
        n = self.name
        return (
            f"{n} lives in the town of {self.town}. {n} works as a {self.job}. "
            f"{n} was born in {self.year}. {n}'s pet is named {self.pet}."
        )

    def questions(self) -> list[tuple[str, str, str]]:
        """(question, answer lead, expected answer) per attribute."""
        n = self.name
        return [
            (f"In which town does {n} live?", f"{n} lives in the town of", self.town),
            (f"What does {n} work as?", f"{n} works as a", self.job),
            (f"In which year was {n} born?", f"{n} was born in", self.year),
            (f"What is the name of {n}'s pet?", f"{n}'s pet is named", self.pet),
        ]


class People:
    """Fictional people with names, towns and pets used nowhere else."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.used: set[str] = set()

    def __next__(self) -> Person:
        rng = self.rng
        while True:
            name = f"{rng.choice(FIRST)} {made_up_word(rng, 2)}"
            town, pet = made_up_word(rng, 2), made_up_word(rng, 2)
            if not {name, town, pet} & self.used:
                self.used.update((name, town, pet))
                job = rng.choice(JOBS)
                return Person(name, town, job, str(rng.randrange(1700, 2000)), pet)


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

    def document(self, people: list[Person]) -> list[int]:
        return self.encode("\n".join(p.record() for p in people) + "\n\n")

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
    client: httpx.Client, segments: list[list[int]], chunked: bool, max_tokens: int
) -> tuple[str, float]:
    """(text, seconds) of a greedy completion of the segments."""
    body: dict = {"model": SERVED_MODEL, "max_tokens": max_tokens, "temperature": 0}
    body["stop"] = ["\n"]
    if chunked:
        body["chunks"] = segments
    else:
        body["prompt"] = [token for segment in segments for token in segment]
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


def accuracy_items(
    prompts: Prompts, people: People, sets: int, docs: int, per_set: int
) -> list[list[Item]]:
    """``sets`` document sets of ``docs`` one-person documents, each asked
    ``per_set`` distinct questions about its people."""
    rng = random.Random(1)
    out = []
    for _ in range(sets):
        persons = [next(people) for _ in range(docs)]
        head = [prompts.system, *(prompts.document([p]) for p in persons)]
        asked = rng.sample([q for p in persons for q in p.questions()], per_set)
        out.append(
            [
                Item([*head, prompts.question(q, lead)], answer)
                for q, lead, answer in asked
            ]
        )
    return out


def ttft_prompts(
    prompts: Prompts, people: People, doc_tokens: int, warm: int
) -> tuple[list[list[int]], list[Item]]:
    """The cold prompt (4 documents of about ``doc_tokens`` tokens) and
    ``warm`` prompts with the same documents in other orders."""
    documents = []
    for _ in range(4):
        persons = [next(people)]
        while len(prompts.document(persons)) < doc_tokens:
            persons.append(next(people))
        documents.append((prompts.document(persons), persons))
    rng = random.Random(2)
    orders = list(itertools.permutations(range(4)))[1:]
    items = []
    for order in rng.sample(orders, warm + 1):
        person = rng.choice(documents[rng.randrange(4)][1])
        question, lead, answer = rng.choice(person.questions())
        segments = [prompts.system, *(documents[i][0] for i in order)]
        items.append(Item([*segments, prompts.question(question, lead)], answer))
    return items[0].segments, items[1:]


def run_mode(
    url: str,
    chunked: bool,
    sets: list[list[Item]],
    cold: list[list[int]],
    warm: list[Item],
    concurrency: int,
) -> tuple[int, int, list[float], float]:
    """(right answers, questions, warm TTFTs, accuracy phase seconds)."""
    started = time.perf_counter()
    with (
        httpx.Client(base_url=url, timeout=1800) as client,
        ThreadPoolExecutor(concurrency) as pool,
    ):
        right = 0
        for phase in ([s[0] for s in sets], [i for s in sets for i in s[1:]]):
            texts = pool.map(
                lambda item: complete(client, item.segments, chunked, 8)[0], phase
            )
            right += sum(
                item.expected.lower() in text.lower()
                for item, text in zip(phase, texts, strict=True)
            )
        seconds = time.perf_counter() - started
        complete(client, cold, chunked, 1)
        ttfts = [complete(client, item.segments, chunked, 1)[1] for item in warm]
    total = sum(len(s) for s in sets)
    return right, total, ttfts, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/smollm2")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--sets", type=int, default=40, help="document sets")
    parser.add_argument("--docs", type=int, default=4, help="documents per set")
    parser.add_argument("--questions-per-set", type=int, default=8)
    parser.add_argument("--ttft-doc-tokens", type=int, default=1000)
    parser.add_argument("--warm", type=int, default=3, help="timed warm prompts")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--kv-cache-gib", default="2")
    ServerSettings.add_arguments(parser)
    args = parser.parse_args()
    settings = ServerSettings.from_args(args)

    prompts = Prompts(args.model)
    people = People(seed=0)
    sets = accuracy_items(prompts, people, args.sets, args.docs, args.questions_per_set)
    cold, warm = ttft_prompts(prompts, people, args.ttft_doc_tokens, args.warm)
    context = statistics.mean(sum(map(len, s[0].segments[:-1])) for s in sets)
    print(
        f"model {args.model}: {sum(map(len, sets))} questions over {len(sets)} sets "
        f"of {args.docs} documents (~{context:.0f} context tokens); TTFT on "
        f"{len(cold)} segments, {sum(map(len, cold))} tokens, {len(warm)} warm"
    )
    logs = Path(tempfile.mkdtemp())
    common = ["--max-model-len", "8192", "--max-num-batched-tokens", "8192"]
    results = {}
    for mode in args.modes:
        extra = [] if mode == "plain" else ["--enable-chunk-cache", *MODES[mode]]
        extra += ["--chunk-cache-device-fraction", "0.5"] if extra else []
        with Server(
            args.model,
            *common,
            *extra,
            log_path=logs / f"{mode}.log",
            settings=settings,
            env={"VLLM_CPU_KVCACHE_SPACE": args.kv_cache_gib},
        ) as server:
            results[mode] = run_mode(
                server.url, mode != "plain", sets, cold, warm, args.concurrency
            )
        right, total, ttfts, seconds = results[mode]
        print(
            f"{mode}: {right}/{total} right ({seconds:.0f} s), warm TTFT "
            f"{[round(t * 1e3) for t in ttfts]} ms",
            flush=True,
        )
    plain_ttft = statistics.median(results["plain"][2]) if "plain" in results else 0
    print(
        "\n| mode | accuracy | 95% interval | warm TTFT p50 (4 x ~1K-token docs) "
        "| plain / mode |"
    )
    print("|---|---|---|---|---|")
    for mode, (right, total, ttfts, _) in results.items():
        low, high = wilson(right, total)
        ttft = statistics.median(ttfts)
        ratio = f"{plain_ttft / ttft:.2f}x" if plain_ttft else "-"
        print(
            f"| {mode} | {right / total:.1%} ({right}/{total}) "
            f"| {low:.1%} - {high:.1%} | {ttft * 1e3:.0f} ms | {ratio} |"
        )


if __name__ == "__main__":
    main()
