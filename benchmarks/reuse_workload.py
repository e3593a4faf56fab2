"""Document kinds and the reuse workload of the chunk cache's quality benchmarks.

A RAG service sees a document first in one prompt, then again in other
prompts, beside other documents. The reuse workload asks questions that way:

- a pool of ``pool`` documents per set, in groups of ``docs``: each group is
  one *first-sight* prompt (system prompt, its documents in order), where
  every document of the pool is seen for the first time;
- then ``warm_prompts`` *warm* prompts of ``docs`` documents of the pool in
  new combinations and orders: no two documents of one first-sight prompt
  stand side by side, and a document never comes after one it followed at
  first sight. So every chunk is warm and never after the neighbours it was
  computed with (its stored KV carries a context the warm prompt lacks);
- one question per document of every prompt (an attribute at random), so
  cold and warm questions come in equal measure per prompt.

``GENERATORS`` names the document kinds: the profiles of
benchmarks/quality_data.py, the data sheets of benchmarks/quality_sheets.py,
and controlled variants of both (who names whom), for finding out what
makes a kind of document hard for the cache.
"""

from __future__ import annotations

import argparse
import itertools
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from quality_data import People, Person  # benchmarks/ is on sys.path
from quality_sheets import Products


class ProfileVariant:
    """Profiles whose best friends are chosen otherwise: ``friends`` is
    "ring" (the next person of the prompt, as ``People.group``), "none" (no
    best friend named) or "outside" (a person with no document); with
    ``unique_first``, no two people of a group share a first name."""

    def __init__(self, seed: int, friends: str, unique_first: bool = False) -> None:
        self.people = People(seed)
        self.friends = friends
        self.unique_first = unique_first

    def group(self, size: int) -> list[Person]:
        group: list[Person] = []
        while len(group) < size:
            person = next(self.people)
            firsts = {other.name.split()[0] for other in group}
            if not (self.unique_first and person.name.split()[0] in firsts):
                group.append(person)
        for number, person in enumerate(group):
            if self.friends == "ring":
                person.friend = group[(number + 1) % size]
            elif self.friends == "outside":
                person.friend = next(self.people)
        return group


# name -> seed -> a source of documents (``group(size)``); "profiles" is the
# fixed-order benchmark's generator, unchanged
GENERATORS: dict[str, Callable[[int], Any]] = {
    "profiles": People,
    "profiles-alone": lambda seed: ProfileVariant(seed, "none"),
    "profiles-outside": lambda seed: ProfileVariant(seed, "outside"),
    "profiles-unique": lambda seed: ProfileVariant(seed, "ring", unique_first=True),
    "profiles-unique-alone": lambda seed: ProfileVariant(seed, "none", True),
    "sheets": Products,
    "sheets-companions": lambda seed: Products(seed, companions=True),
}


@dataclass(slots=True)
class ReuseSet:
    """One pool: its documents' tokens, first-sight and warm prompts (pool
    indices in order) and the questions on them (``Item``s)."""

    subjects: list[Any]
    documents: list[list[int]]
    first: list[list[int]]
    warm: list[list[int]]
    items: list[Any]


def fits(order: list[int], group: list[int], place: list[int]) -> bool:
    """Whether ``order`` puts no document beside one of its first-sight
    prompt (``group``) nor after one it followed there (``place``)."""
    for j, doc in enumerate(order):
        if j and group[order[j - 1]] == group[doc]:
            return False
        for earlier in order[:j]:
            if group[earlier] == group[doc] and place[earlier] < place[doc]:
                return False
    return True


def warm_orders(
    pool: int, docs: int, count: int, rng: random.Random
) -> list[list[int]]:
    """``count`` distinct warm prompts of ``docs`` pool documents that fit,
    each choosing first the documents the earlier ones used least."""
    group = [d // docs for d in range(pool)]
    place = [d % docs for d in range(pool)]
    used = [0] * pool
    orders: list[list[int]] = []
    for _ in range(count):
        for attempt in range(10_000):  # the least used first, less so each try
            spread = 1 + attempt / 100
            ranked = sorted(range(pool), key=lambda d: used[d] + spread * rng.random())
            order = ranked[:docs]
            rng.shuffle(order)
            if fits(order, group, place) and order not in orders:
                break
        else:
            raise ValueError(f"no warm prompt of {docs} fits a pool of {pool}")
        orders.append(order)
        for d in order:
            used[d] += 1
    return orders


def reuse_sets(
    prompts: Any,
    source: Any,
    args: Any,
    item: Callable[..., Any],
    same_order: bool = False,
) -> list[ReuseSet]:
    """``args.sets`` pools of ``args.pool`` documents of about
    ``args.doc_tokens`` tokens from ``source``, first seen ``args.docs`` a
    prompt, then in ``args.warm_prompts`` warm prompts (``same_order``: the
    first-sight prompts again, with other questions); ``item(segments,
    expected, warm=, prompt=, docs=, asked=, ...)`` makes a question.

    Per prompt: ``args.per_doc`` one-document questions per document (other
    attributes; default 1), then, with ``args.pairs``, the two-document
    questions: for every two documents standing side by side, both orders
    of naming them (``pair_question``: where both are; right only if the
    answer names both towns and no other document's). Neighbours only:
    full attention on this model names both towns of two neighbours 38-47%
    of the time, of two documents with one between them 7-15% (measured
    2026-11, 30 pairs each), near the 1 in 6 of naming two of the prompt's
    four towns at random."""
    if args.pool % args.docs or args.pool < 2 * args.docs:
        raise ValueError("--pool must be a multiple of --docs, at least twice it")
    seed = getattr(args, "seed", 0)
    rng = random.Random(3 if not seed else 3 + 1000 * seed)
    per_doc, pairs = getattr(args, "per_doc", 1), getattr(args, "pairs", False)
    out = []
    for number in range(args.sets):
        subjects = [s for _ in range(args.pool // args.docs)
                    for s in source.group(args.docs)]  # fmt: skip
        documents = [prompts.document(s, rng, args.doc_tokens) for s in subjects]
        first = [list(range(g, g + args.docs)) for g in range(0, args.pool, args.docs)]
        warm = warm_orders(args.pool, args.docs, args.warm_prompts, rng)
        if same_order:
            warm = [list(order) for order in first]
        items = []
        for kind, orders in (("c", first), ("w", warm)):
            for index, order in enumerate(orders):
                head = [prompts.system, *(documents[d] for d in order)]
                for question, lead, answer, more in questions(
                    subjects, order, per_doc, pairs, rng
                ):
                    items.append(
                        item(
                            [*head, prompts.question(question, lead)], answer,
                            warm=kind == "w", prompt=f"{number}.{kind}{index}",
                            docs=tuple(order), **more,
                        )
                    )  # fmt: skip
        out.append(ReuseSet(subjects, documents, first, warm, items))
    return out


def questions(
    subjects: list[Any], order: list[int], per_doc: int, pairs: bool, rng: Any
) -> list[tuple[str, str, str, dict[str, Any]]]:
    """One prompt's questions: (question, answer lead, expected value, the
    item's other fields), the one-document questions first."""
    out = []
    for asked in order:
        if per_doc == 1:  # the draws of the runs before per_doc
            asks = [rng.choice(subjects[asked].questions())]
        else:
            asks = rng.sample(subjects[asked].questions(), per_doc)
        out += [(q, lead, answer, {"asked": asked}) for q, lead, answer in asks]
    for a, b in pair_orders(order) if pairs else []:
        question, lead, (town, other) = subjects[a].pair_question(subjects[b])
        rivals = tuple(subjects[d].town for d in order if d not in (a, b))
        more = {"asked": a, "also": other, "rivals": rivals, "two_hop": True}
        out.append((question, lead, town, {**more, "max_tokens": 28}))
    return out


def pair_orders(order: list[int]) -> list[tuple[int, int]]:
    """Every two documents side by side in ``order``, named both ways."""
    return [pair for a, b in itertools.pairwise(order) for pair in ((a, b), (b, a))]


def ttft_pool(
    prompts: Any, generator: Callable[[int], Any], mode: str, args: Any, item: Any
) -> tuple[list[Any], list[Any]]:
    """A pool of its own for ``mode`` (modes share servers, so only
    documents no mode sent before are a first sight): its first-sight
    prompts and ``args.warm`` warm prompts, documents of about
    ``args.ttft_doc_tokens`` tokens, one question each."""
    options = argparse.Namespace(
        sets=1, pool=2 * args.docs, docs=args.docs,
        doc_tokens=args.ttft_doc_tokens, warm_prompts=args.warm,
    )  # fmt: skip
    source = generator(zlib.crc32(mode.encode()))
    items = reuse_sets(prompts, source, options, item)[0].items
    one = [i for n, i in enumerate(items) if n % args.docs == 0]
    return [i for i in one if not i.warm], [i for i in one if i.warm]


def phases(items: list[Any]) -> list[list[Any]]:
    """The order questions are sent in: the first question of every
    first-sight prompt (it computes the prompt's documents), the other
    first-sight questions, then the warm prompts, the first of every set,
    then the second..., each phase at once."""
    first: list[Any] = []
    rest: list[Any] = []
    warm: dict[int, list[Any]] = {}
    seen: set[str] = set()
    for i in items:
        if i.warm:
            warm.setdefault(int(i.prompt.split(".w")[1]), []).append(i)
        elif i.prompt in seen:
            rest.append(i)
        else:
            seen.add(i.prompt)
            first.append(i)
    return [first, rest, *(warm[k] for k in sorted(warm))]
