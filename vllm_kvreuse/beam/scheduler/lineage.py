"""A group stepped as one keeps its beams as back-pointers, not sequences.

Following a live step member by member (:meth:`.live.LiveSteps.apply`) the
scheduler builds every next beam's sequence (its parent's tokens and one
more) and rewrites each member's token history: per step, work and copies
that grow with the width and the length. A group stepped as one
(:mod:`.as_one`) needs none of it until someone reads a sequence: the
workers hold the beams and the group's requests are out of upstream's loop.
So each step only appends the workers' arrays (each next beam's parent
index, token, score, member), and sequences are built from those
back-pointers when they are read: the final beams and the completed ones
when the group ends, every beam and member history when the group goes
back to member by member (:meth:`.as_one.OneRequestSteps.leave`).

The order of completed beams is the host rule's
(:func:`~vllm_kvreuse.beam.rule.step_from_result`: per step, catalog items
complete as they are, then EOS endings, each in beam order), so the final
ranking, a stable sort, is the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.entrypoints.generate.beam_search.utils import BeamSearchSequence

from vllm_kvreuse.beam.plan import GroupResult
from vllm_kvreuse.beam.rule import Beam, BeamConfig


@dataclass(slots=True)
class Ending:
    """A beam completed at ``step`` (its index among that step's beams):
    a catalog item as it is (``eos`` None), or by EOS with ``score``."""

    step: int
    beam: int
    score: float
    eos: int | None


@dataclass(slots=True)
class Lineage:
    """Beams since ``base`` (the group's beams when it began, whole
    sequences), as each step's arrays. Step ``s`` (from 1) holds, per next
    beam, ``parents[s - 1]`` (its parent's index among step ``s - 1``'s
    beams; step 0's are ``base``), ``tokens``, ``scores``, ``carriers`` (its
    member's index). ``nodes``: the current beams' trie nodes (catalog
    groups; empty for plain ones after their first step).
    ``outputs``: output tokens each member held when it began (its count
    then grows by one a step).
    """

    base: list[Beam]
    outputs: int
    nodes: list[int]
    parents: list[list[int]] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    scores: list[list[float]] = field(default_factory=list)
    carriers: list[list[int]] = field(default_factory=list)
    endings: list[Ending] = field(default_factory=list)

    @property
    def num_steps(self) -> int:
        return len(self.parents)

    @property
    def num_beams(self) -> int:
        """The current beams (the last step's)."""
        return len(self.parents[-1]) if self.parents else len(self.base)

    def current_carriers(self, members: list[str]) -> list[int]:
        """The member index of each current beam."""
        if self.carriers:
            return self.carriers[-1]
        index = {request_id: i for i, request_id in enumerate(members)}
        return [index[beam.request_id] for beam in self.base]

    def cum(self, beam: int) -> float:
        """Current beam ``beam``'s score."""
        if self.scores:
            return self.scores[-1][beam]
        return self.base[beam].seq.cum_logprob

    @classmethod
    def begin(cls, beams: list[Beam], outputs: int) -> Lineage:
        return cls(list(beams), outputs, [beam.node for beam in beams])

    def record(self, result: GroupResult, nodes: list[int], eos: int | None) -> None:
        """Appends a step: its completed beams first (of the current
        beams), then the next beams; ``nodes``: theirs (catalog)."""
        step = self.num_steps
        for beam, done in enumerate(result.leaf_done) if any(result.leaf_done) else ():
            if done:
                self.endings.append(Ending(step, beam, self.cum(beam), None))
        if eos is not None and any(s is not None for s in result.eos_scores):
            for beam, score in enumerate(result.eos_scores):
                if score is not None:
                    self.endings.append(Ending(step, beam, score, eos))
        self.parents.append(result.parents)
        self.tokens.append(result.tokens)
        self.scores.append(result.scores)
        self.carriers.append(result.carriers)
        self.nodes = nodes

    # -- sequences, when read ------------------------------------------------------

    def tokens_of(self, step: int, beam: int) -> list[int]:
        """The whole token sequence of beam ``beam`` of step ``step``."""
        tail: list[int] = []
        for s in range(step, 0, -1):
            tail.append(self.tokens[s - 1][beam])
            beam = self.parents[s - 1][beam]
        return [*self.base[beam].seq.tokens, *reversed(tail)]

    def sequences(self) -> list[BeamSearchSequence]:
        """The current beams' sequences, best first."""
        step = self.num_steps
        return [
            self._sequence(self.tokens_of(step, b), self.cum(b))
            for b in range(self.num_beams)
        ]

    def completed(self, config: BeamConfig) -> list[BeamSearchSequence]:
        """Every completed beam, in the order they completed."""
        done = []
        for end in self.endings:
            tokens = self.tokens_of(end.step, end.beam)
            if end.eos is None:
                done.append(self._sequence(tokens, end.score, "length"))
                continue
            if config.include_stop_str_in_output:
                tokens.append(end.eos)
            done.append(self._sequence(tokens, end.score, "stop", end.eos))
        return done

    def beams(self, members: list[str]) -> list[Beam]:
        """The current beams as the member by member path keeps them."""
        carriers = self.current_carriers(members)
        return [
            Beam(seq, members[carriers[b]], self.nodes[b] if self.nodes else 0)
            for b, seq in enumerate(self.sequences())
        ]

    def _sequence(
        self,
        tokens: list[int],
        cum: float,
        finish_reason: str | None = None,
        stop_reason: int | None = None,
    ) -> BeamSearchSequence:
        return BeamSearchSequence(
            orig_prompt=self.base[0].seq.orig_prompt,
            tokens=tokens,
            logprobs=[],
            cum_logprob=cum,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )
