"""Made-up people and their profiles, for the chunk cache's quality benchmark.

Each document is the profile of one fictional person (a seeded made-up name,
town and pet, a job, a birth year, a best friend among the other people of
the prompt): the name in its first sentence, the facts among narrative
sentences, about half of them by pronoun ("She was born in 1841."). So a
fact belongs to its person only through the document around it, as in the
documents users retrieve, and a model that cannot tell the documents apart
answers with another person's fact.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


def words(text: str) -> list[str]:
    return text.split()


FIRST = {
    **dict.fromkeys(words("Anna Maria Clara Lena Ida Nora Greta Olga"), "she"),
    **dict.fromkeys(words("Tom Peter Hugo Oscar Felix Victor Anton Emil"), "he"),
}
JOBS = words(
    "baker sailor glassblower locksmith beekeeper cartographer potter "
    "blacksmith astronomer weaver carpenter violinist gardener tailor brewer "
    "jeweler surgeon miner librarian"
)
ONSETS = words("b br d dr f g gr k kr l m n p pr r s st t tr v z th sh")
VOWELS = words("a e i o u ai ou ei")
CODAS = ["", "", "n", "r", "l", "s", "th", "m", "k", "x"]
FILLER = [
    "{P} likes to get up early and make a large pot of tea.",
    "In the afternoons {p} often reads old books in the garden.",
    "Friends describe {o} as patient, curious and a little stubborn.",
    "{P} once walked across the whole country in a single summer.",
    "On weekends {p} visits the market to buy fresh bread and cheese.",
    "{P} keeps a diary and writes a few lines in it every evening.",
    "Some years ago {p} learned to play chess from a neighbour.",
    "{P} prefers quiet places and avoids crowded streets.",
    "Every winter {p} spends a week in the mountains.",
    "{P} collects postcards from places {p} has never been to.",
    "When it rains, {p} likes to cook soup for the whole street.",
    "{P} is known for telling long stories at family dinners.",
    "As a child {p} wanted to become a famous singer.",
    "{P} has a small workshop behind the house.",
    "Most mornings {p} takes the same path along the river.",
    "{P} does not like coffee, but drinks it to be polite.",
    "Last spring {p} planted a row of apple trees.",
    "{P} enjoys long conversations about history and old maps.",
    "{P} rarely travels by train and prefers to ride a bicycle.",
    "In the evenings {p} listens to the radio for an hour.",
    "{P} speaks three languages, though none of them perfectly.",
    "Neighbours often ask {o} for advice about their gardens.",
    "{P} repaired the roof of the old barn without any help.",
    "Once a month {p} writes a letter to a cousin abroad.",
    "{P} believes that a good walk solves most problems.",
    "During the holidays {p} bakes bread for the neighbours.",
    "{P} keeps every tool in the house clean and sharp.",
    "{P} learned to swim late, at the age of thirty.",
    "On cold days {p} sits by the stove and mends clothes.",
    "{P} has a habit of humming while working.",
]


def made_up_word(rng: random.Random, syllables: int) -> str:
    return "".join(
        rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)
        for _ in range(syllables)
    ).capitalize()


@dataclass(slots=True)
class Person:
    name: str
    town: str
    job: str
    year: str
    pet: str
    friend: Person | None = field(default=None, repr=False)

    @property
    def pronoun(self) -> str:
        return FIRST[self.name.split()[0]]

    def facts(self, rng: random.Random) -> list[str]:
        """The person's facts, each by name or, at random, by pronoun."""
        p, n = self.pronoun.capitalize(), self.name
        own = "Her" if self.pronoun == "she" else "His"
        pairs = [
            (f"{n} lives in the town of {self.town}.",
             f"{p} lives in the town of {self.town}."),
            (f"{n} works as a {self.job}.", f"{p} works as a {self.job}."),
            (f"{n} was born in {self.year}.", f"{p} was born in {self.year}."),
            (f"{n}'s pet is named {self.pet}.", f"{own} pet is named {self.pet}."),
        ]  # fmt: skip
        facts = [pair[rng.random() < 0.5] for pair in pairs]
        if self.friend is not None:
            facts.append(f"{n}'s best friend is {self.friend.name}.")
        return facts

    def profile(self, rng: random.Random, sentences: int) -> str:
        """The name first, then the facts among ``sentences`` fillers."""
        p = self.pronoun
        o = "her" if p == "she" else "him"
        fill = [
            s.format(P=p.capitalize(), p=p, o=o)
            for s in rng.sample(FILLER * (1 + sentences // len(FILLER)), sentences)
        ]
        body = fill + self.facts(rng)
        rng.shuffle(body)
        return " ".join([f"This is the profile of {self.name}.", *body])

    def questions(self) -> list[tuple[str, str, str]]:
        """(question, answer lead, expected answer) per attribute."""
        n = self.name
        return [
            (f"In which town does {n} live?", f"{n} lives in the town of", self.town),
            (f"What does {n} work as?", f"{n} works as a", self.job),
            (f"In which year was {n} born?", f"{n} was born in", self.year),
            (f"What is the name of {n}'s pet?", f"{n}'s pet is named", self.pet),
        ]

    def pair_question(self, other: Person) -> tuple[str, str, tuple[str, str]]:
        """A question that needs this profile and ``other``'s: where both
        live, this person's town first (question, answer lead, the towns).
        The answer's form is spelled out: this model then names both towns
        far more often (benchmarks/reuse_workload.py, two-document questions)."""
        a, b = self.name, other.name
        return (
            f"In which towns do {a} and {b} live? Answer in the form: {a} lives "
            f"in the town of ..., and {b} lives in the town of ...",
            f"{a} lives in the town of",
            (self.town, other.town),
        )

    def two_hop(self) -> tuple[str, str, str]:
        """A question that needs this person's profile and the friend's."""
        assert self.friend is not None
        n, f = self.name, self.friend
        return (
            f"In which town does {n}'s best friend live?",
            f"{n}'s best friend lives in the town of",
            f.town,
        )


class People:
    """Fictional people with names, towns and pets used nowhere else."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.used: set[str] = set()

    def __next__(self) -> Person:
        rng = self.rng
        while True:
            name = f"{rng.choice(list(FIRST))} {made_up_word(rng, 2)}"
            town, pet = made_up_word(rng, 2), made_up_word(rng, 2)
            if not {name, town, pet} & self.used:
                self.used.update((name, town, pet))
                job = rng.choice(JOBS)
                return Person(name, town, job, str(rng.randrange(1700, 2000)), pet)

    def group(self, size: int) -> list[Person]:
        """``size`` people, each the best friend of the next (a ring)."""
        group = [next(self) for _ in range(size)]
        for number, person in enumerate(group):
            person.friend = group[(number + 1) % size]
        return group
