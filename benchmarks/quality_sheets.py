"""Made-up products and their data sheets: the chunk cache's second kind of
document, for its quality benchmarks.

Each document is the data sheet of one fictional product (a seeded made-up
name and a kind: "the Vornak pump"), named once, in its first sentence; every
other sentence speaks of it by reference ("The unit", "It", "Its"), the
facts among them: the town it is built in, the year it was first sold, what
its frame is made of, its code name. So a fact belongs to its product only
through the document around it, more strictly than in the profiles
(benchmarks/quality_data.py), whose facts name their person half the time.
By default no sheet names another product (the profiles name a best friend);
``Products(seed, companions=True)`` adds one ("Its companion product is the
Brelmor lantern."), naming the next product of the group, and a two-document
question about it, for the benchmarks' controlled variants.

The interface is the profiles' (``group``, ``profile``, ``questions``,
``pair_question``, ``two_hop``, ``friend``, ``town``), so the benchmarks
take either kind.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from quality_data import made_up_word, words  # benchmarks/ is on sys.path

KINDS = words(
    "pump lantern clock loom stove drill valve press kettle scale compass "
    "lathe boiler winch mill heater radio camera"
)
MATERIALS = words(
    "brass steel oak copper iron bronze walnut aluminium pewter glass "
    "ceramic granite bamboo marble tin"
)
FILLER = [
    "The unit should be cleaned once a month with a dry cloth.",
    "It runs quietly enough to be used in a small office.",
    "Its handle folds away when it is not in use.",
    "The unit is delivered in a wooden crate with a printed manual.",
    "It should be kept away from open flames and strong magnets.",
    "Most owners use it every day for several years without repairs.",
    "Its moving parts need a drop of oil every spring.",
    "The unit can be carried by two people without special tools.",
    "It was tested for a full year before the first delivery.",
    "Spare parts for it are sold by most hardware stores.",
    "The unit switches itself off after an hour without use.",
    "It works best in dry rooms at an even temperature.",
    "Its outer panels can be removed with a single screwdriver.",
    "The unit comes with a guarantee of five years.",
    "It won a prize at a trade fair for its simple design.",
    "Its paint resists rain, frost and strong sunlight.",
    "The unit is often used in schools, farms and small workshops.",
    "It can be mounted on a wall or placed on a sturdy table.",
    "Its manual explains every part with clear drawings.",
    "The unit makes a soft clicking sound when it starts.",
    "It needs about ten minutes to warm up on cold mornings.",
    "Its feet are covered with rubber to protect the floor.",
    "The unit can be repaired by any trained mechanic.",
    "It uses less energy than most machines of its kind.",
    "Its control knob has three settings marked with simple symbols.",
    "The unit was designed to be taken apart and rebuilt easily.",
    "It should be checked by a technician every second year.",
    "Its cover keeps dust out of the inner mechanism.",
    "The unit is packed with a small bag of spare screws.",
    "It is light enough to be moved from room to room.",
]


@dataclass(slots=True)
class Product:
    name: str  # "Vornak pump"
    town: str
    year: str
    material: str
    code: str
    friend: Product | None = field(default=None, repr=False)  # its companion

    def facts(self, rng: random.Random) -> list[str]:
        """The product's facts, each by one of two references, at random."""
        pairs = [
            (f"The unit is built in the town of {self.town}.",
             f"It is built in the town of {self.town}."),
            (f"The unit was first sold in {self.year}.",
             f"It was first sold in {self.year}."),
            (f"Its frame is made of {self.material}.",
             f"The frame of the unit is made of {self.material}."),
            (f"Its code name is {self.code}.",
             f"The code name of the unit is {self.code}."),
        ]  # fmt: skip
        facts = [pair[rng.random() < 0.5] for pair in pairs]
        if self.friend is not None:
            facts.append(f"Its companion product is the {self.friend.name}.")
        return facts

    def profile(self, rng: random.Random, sentences: int) -> str:
        """The data sheet: the name first, then the facts among
        ``sentences`` fillers (named ``profile`` as the people's are)."""
        fill = rng.sample(FILLER * (1 + sentences // len(FILLER)), sentences)
        body = fill + self.facts(rng)
        rng.shuffle(body)
        return " ".join([f"This is the data sheet of the {self.name}.", *body])

    def questions(self) -> list[tuple[str, str, str]]:
        """(question, answer lead, expected answer) per attribute."""
        n = self.name
        return [
            (f"In which town is the {n} built?",
             f"The {n} is built in the town of", self.town),
            (f"In which year was the {n} first sold?",
             f"The {n} was first sold in", self.year),
            (f"What is the frame of the {n} made of?",
             f"The frame of the {n} is made of", self.material),
            (f"What is the code name of the {n}?",
             f"The code name of the {n} is", self.code),
        ]  # fmt: skip

    def pair_question(self, other: Product) -> tuple[str, str, tuple[str, str]]:
        """A question that needs this sheet and ``other``'s: where both are
        built, this product's town first (question, answer lead, the towns).
        No form spelled out: on sheets this model names both towns more
        often without one (benchmarks/reuse_workload.py)."""
        a, b = self.name, other.name
        return (
            f"In which towns are the {a} and the {b} built?",
            f"The {a} is built in the town of",
            (self.town, other.town),
        )

    def two_hop(self) -> tuple[str, str, str]:
        """A question that needs this sheet and its companion's."""
        assert self.friend is not None, "two-document questions need companions"
        n, f = self.name, self.friend
        return (
            f"In which town is the companion product of the {n} built?",
            f"The companion product of the {n} is built in the town of",
            f.town,
        )


class Products:
    """Fictional products with names, towns and code names used nowhere else."""

    def __init__(self, seed: int, companions: bool = False) -> None:
        self.rng = random.Random(seed)
        self.used: set[str] = set()
        self.companions = companions

    def __next__(self) -> Product:
        rng = self.rng
        while True:
            word = made_up_word(rng, 2)
            town, code = made_up_word(rng, 2), made_up_word(rng, 2)
            if not {word, town, code} & self.used:
                self.used.update((word, town, code))
                name = f"{word} {rng.choice(KINDS)}"
                year = str(rng.randrange(1850, 2020))
                return Product(name, town, year, rng.choice(MATERIALS), code)

    def group(self, size: int) -> list[Product]:
        """``size`` products; with companions, each the next one's (a ring)."""
        group = [next(self) for _ in range(size)]
        if self.companions:
            for number, product in enumerate(group):
                product.friend = group[(number + 1) % size]
        return group
