"""A beam group's state, and the engine request of one of its beams.

Free of the hook layer: :class:`BeamGroup` is everything one search
remembers between steps; :func:`member_request` builds the request that
computes one beam's next token. Who changes a group (nobody else):

- the group table (:mod:`.groups`): creates it; counts each member it
  spawns (``num_forks``, ``num_copied_blocks``);
- the feature (:mod:`.feature`): ``phase``; what a step's outputs bring
  (``result``, ``snapshots``, ``delivered``, the root's ``prefill_stats``
  and ``kv_transfer_params``, ``num_member_computed_tokens``); what
  applying a step changes (``step``, ``completed``, ``previous``, and
  ``beams`` as a strategy returns them);
- the step strategies: :mod:`.live` (``members``, ``started``, ``outside``,
  ``snapshots`` once applied, and the moves it counts), :mod:`.fork`
  (``rows``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from vllm.entrypoints.generate.beam_search.utils import BeamSearchSequence
from vllm.v1.request import Request

from vllm_kvreuse.beam.plan import GroupResult, GroupStep
from vllm_kvreuse.beam.result import BeamOut, BeamResult
from vllm_kvreuse.beam.rule import Beam, BeamConfig, Row
from vllm_kvreuse.beam.scheduler.group_rule import PlainRule
from vllm_kvreuse.beam.scheduler.lineage import Lineage
from vllm_kvreuse.core.internal import derived_request
from vllm_kvreuse.core.request_keys import PARENT
from vllm_kvreuse.core.upstream.requests import never_stop, share_block_hashes


class Phase(Enum):
    """Where a group's beams live: in the root (its prefill samples the
    first step), in members that live across steps (:mod:`.live`), or in
    one new request per beam per step (:mod:`.fork`). Chosen once, after
    the root's step."""

    ROOT = "root"
    LIVE = "live"
    FORK = "fork"


@dataclass(slots=True)
class BeamGroup:
    """One beam search: its root request and the beams of the current step.

    ``previous``: last step's beams, whose KV is held until this step's
    beams (their children) have run. ``members``: a live group's requests,
    one per place (``width``), fixed from its first step to its last; each
    carries one beam or none (``Beam.request_id`` names the carrier).
    ``started``: the workers hold the live group's beams
    (:mod:`~vllm_kvreuse.beam.plan`).
    ``result``: a step the worker ran next to the logits (root and live
    phases), until it is applied, with ``snapshots`` (the histories of
    moved beams' parents, read before the step's tokens were appended);
    ``rows``: the members' log-prob rows of a fork step, until all are in.
    ``delivered``: the root's sample of its step came (a preemption may
    drop it: the root then samples again); ``outside``: members with a
    sample in flight made outside a group step (taken back when it comes).
    """

    root: Request
    config: BeamConfig
    rule: PlainRule  # plain or catalog (:mod:`.group_rule`)
    beams: list[Beam]
    phase: Phase = Phase.ROOT
    members: list[str] = field(default_factory=list)
    started: bool = False
    # Stepped as one (:mod:`.as_one`): members out of upstream's loop, the
    # group's step added whole; ``unsent``: admitted as one (its members'
    # first rows go to the workers whole); ``new_blocks``: reserved block ids per
    # member, sent with its next step;
    # ``tables``: the members' block tables, fixed while stepped as one;
    # ``held``: the member requests then (the scheduler's own objects);
    # ``private``: the members' private blocks up to a block count, kept
    # until a step's positions reach a new block.
    as_one: bool = False
    unsent: bool = False
    new_blocks: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    tables: list[tuple[list[int], ...]] | None = None
    held: list[Request] | None = None
    private: tuple[int, list[list[list[int]]]] | None = None
    # Its beams as back-pointers while stepped as one (:mod:`.lineage`):
    # ``beams`` are then those it began with.
    lineage: Lineage | None = None
    result: GroupResult | None = None
    snapshots: dict[int, tuple[int, list[int] | None]] = field(default_factory=dict)
    rows: dict[str, Row] = field(default_factory=dict)
    delivered: set[str] = field(default_factory=set)
    outside: set[str] = field(default_factory=set)
    completed: list[BeamSearchSequence] = field(default_factory=list)
    previous: list[str] = field(default_factory=list)
    step: int = 0
    prefill_stats: Any = None
    # What a KV connector returned with the root's prefill (P/D): passed on
    # unchanged in the group's final output.
    kv_transfer_params: dict[str, Any] | None = None
    num_forks: int = 0
    num_copied_blocks: int = 0
    # Prompt tokens the beams computed. Their outputs never reach the
    # frontend, so vLLM's own prompt-token metrics do not see them.
    num_member_computed_tokens: int = 0
    num_steps_as_one: int = 0  # steps run as extra rows (:mod:`.as_one`)

    @classmethod
    def start(cls, root: Request, config: BeamConfig, rule: PlainRule) -> BeamGroup:
        """A group whose one beam is the root itself (its prompt)."""
        prompt = list(root.prompt_token_ids or [])
        seq = BeamSearchSequence(orig_prompt=None, tokens=prompt, logprobs=[])
        beams = [Beam(seq, root.request_id)]
        return cls(root=root, config=config, rule=rule, beams=beams)

    @property
    def root_id(self) -> str:
        return self.root.request_id

    @property
    def prompt_len(self) -> int:
        return self.root.num_prompt_tokens

    @property
    def num_beams(self) -> int:
        """This step's beams."""
        return self.lineage.num_beams if self.lineage else len(self.beams)

    @property
    def member_ids(self) -> list[str]:
        """The requests carrying this step's beams, in beam order."""
        return [beam.request_id for beam in self.beams]

    @property
    def sampling_ids(self) -> list[str]:
        """The requests whose rows a step of the group samples: a live
        group's members, else the beams' requests (the root's, fork
        members')."""
        return self.members if self.phase is Phase.LIVE else self.member_ids

    def has_step(self) -> bool:
        """A whole step is in, to be applied: the root's (its result, and its
        own sample delivered), a live group's (the workers applied it), or
        every fork member's row."""
        if self.phase is Phase.FORK:
            return bool(self.rows) and len(self.rows) == len(self.beams)
        if self.phase is Phase.ROOT and self.root_id not in self.delivered:
            return False
        return self.result is not None

    @property
    def beam_ids(self) -> list[str]:
        """Requests whose KV the group may hold: last step's and this step's."""
        return self.previous + self.member_ids

    def plan(self, blocks: list[list[list[int]]] | None = None) -> GroupStep:
        """This step as the workers run it next to the logits
        (:mod:`~vllm_kvreuse.beam.plan`): a root's, a live group's first
        (its beams' state) or a later one; ``blocks``: the members' private
        blocks, per KV-cache group."""
        config = self.config
        ends = config.eos_token_id is not None and not config.ignore_eos
        rule = dict(
            width=config.width,
            eos=config.eos_token_id if ends and config.eos_token_id is not None else -1,
            row_size=config.row_size,
            catalog=config.sid_catalog,
        )
        if self.phase is Phase.LIVE and self.started:
            return GroupStep(self.root_id, "step", self.members, blocks=blocks, **rule)
        members = self.members if self.phase is Phase.LIVE else [self.root_id]
        return GroupStep(
            self.root_id,
            "start" if self.phase is Phase.LIVE else "root",
            members,
            carriers=[members.index(beam.request_id) for beam in self.beams],
            cum_logprobs=[beam.seq.cum_logprob for beam in self.beams],
            nodes=[beam.node for beam in self.beams] if config.sid_catalog else None,
            blocks=blocks,
            **rule,  # type: ignore[arg-type]
        )

    def result_of(self, final: list[BeamSearchSequence]) -> BeamResult:
        """What the root's client receives: ``final`` beams, best first."""
        return BeamResult(
            beams=[
                BeamOut(
                    token_ids=seq.tokens[self.prompt_len :],
                    cum_logprob=seq.cum_logprob,
                    finish_reason=seq.finish_reason or "length",
                    stop_reason=seq.stop_reason,
                )
                for seq in final
            ],
            forks=self.num_forks,
            copied_blocks=self.num_copied_blocks,
            member_computed_tokens=self.num_member_computed_tokens,
            steps_as_one=self.num_steps_as_one,
        )


def member_request(
    group: BeamGroup,
    tokens: list[int],
    parent_id: str,
    index: int,
    extra_args: dict[str, Any],
    hash_block_size: int,
) -> Request:
    """The request of beam ``index`` of the group's next step.

    Its prompt is the beam's ``tokens``; it names ``parent_id``, whose held
    blocks it inherits (:mod:`vllm_kvreuse.core.ledger`), and computes one
    token. ``extra_args`` go next to the parent's name (catalog node).
    A live member (:attr:`Phase.LIVE`) runs until the group aborts it: it
    never stops on its own (no EOS, no stop tokens, a token budget for the
    whole search) and asks for no log-probs (its group's step runs next to
    the logits); a fork member asks for the log-probs its row needs.
    """
    root = group.root
    assert root.sampling_params is not None
    # Shallow: members only read their params, and a deep copy per beam
    # per step was the largest cost of a step (as vLLM's own internal
    # beam search, which sets skip_clone).
    sampling = copy.copy(root.sampling_params)
    sampling.extra_args = {PARENT: parent_id, **extra_args}
    if group.phase is Phase.LIVE:
        # Tokens 2 .. max_tokens, and one more: the group aborts the member
        # after its last step. A member whose last token was sampled outside
        # a group step (a preemption cut the batch) must not have ended by
        # its length there: that sample is taken back and run again.
        sampling.max_tokens = group.config.max_tokens
        sampling.logprobs = None
        never_stop(sampling)
    else:
        sampling.logprobs = group.config.num_logprobs
    request_id = f"{root.request_id}-beam{group.step}-{index}"
    request = derived_request(root, request_id, list(tokens), sampling)
    # Every beam starts with the root's prompt: reuse its full-block
    # hashes and hash only the blocks past them. A live member's blocks past
    # them change content under it (it takes other beams' KV): hashes no
    # other request can have keep them out of everyone's prefix-cache hits.
    num_shared = root.num_prompt_tokens // hash_block_size
    private = hash_block_size if group.phase is Phase.LIVE else None
    share_block_hashes(request, root, num_shared, private)
    return request
