"""The soak's texts: plain prompts, a pool of RAG documents, RAG prompts.

Everything is drawn from the caller's seeded RNG, so one seed gives one
sequence of prompts. Words come from the tiny model's tokenizer vocabulary
(about one token a word), so prompt lengths in tokens are predictable:
documents of 80-200 words are 80-210 tokens, RAG prompts of 2-4 documents
200-850 tokens, inside the tests' 1,024-token context with room for the
answer. At concurrency 16 that is more than the soak's 192 blocks of 32
tokens hold, which is the point: the pool runs full and requests preempt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_VOCABULARY = (
    "the of and to in is that for it as with was on be by this are from at or an "
    "which have not but they were all one their has there been more when user "
    "item watch video music buy like recommend history think answer document "
    "question system context retrieve cache block token model request beam search "
    "prefix chunk position rotary attention value key query layer head serve "
    "engine schedule memory pool copy write fork alpha beta gamma delta epsilon "
    "zeta theta kappa lambda sigma omega"
)
WORDS = tuple(_VOCABULARY.split())

Prompt = str | list[str]
"""A plain text prompt, or a RAG prompt's segments (sent as ``chunks``)."""


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


@dataclass(frozen=True, slots=True)
class Corpus:
    """Fixed texts of one soak: system prompts and the document pool."""

    systems: tuple[str, ...]
    documents: tuple[str, ...]

    @classmethod
    def build(cls, seed: int, num_documents: int = 30) -> Corpus:
        rng = random.Random(f"corpus-{seed}")
        systems = tuple(
            f"System {n}: answer from the documents. {words(rng, 12)}" for n in range(3)
        )
        documents = tuple(
            f"Document {n}: {words(rng, rng.randint(80, 200))}"
            for n in range(num_documents)
        )
        return cls(systems, documents)

    def plain_prompt(self, rng: random.Random) -> str:
        """A plain prompt, 10-400 words; a fresh tag keeps them
        from being prefix-cache hits."""
        return f"Request {rng.randrange(10**9)}: {words(rng, rng.randint(10, 400))}"

    def rag_prompt(self, rng: random.Random) -> list[str]:
        """Segments ``[system, doc, doc[, doc[, doc]], question]``: 2-4
        distinct pool documents in random order."""
        docs = rng.sample(self.documents, rng.randint(2, 4))
        question = f"Question {rng.randrange(10**6)}: what about {rng.choice(WORDS)}?"
        return [rng.choice(self.systems), *docs, question]

    def any_prompt(self, rng: random.Random) -> Prompt:
        return self.rag_prompt(rng) if rng.random() < 0.5 else self.plain_prompt(rng)
