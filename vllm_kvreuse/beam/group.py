"""A beam group's state, and the engine request of one of its beams.

Free of the hook layer: :class:`BeamGroup` is what one search remembers
between steps; :func:`member_request` builds the request that computes one
beam's next token. Both are read and mutated only by
:class:`~vllm_kvreuse.beam.feature.EngineBeamSearch`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from vllm.entrypoints.generate.beam_search.utils import BeamSearchSequence
from vllm.v1.request import Request

from vllm_kvreuse.beam.policy import Beam, BeamConfig, Row
from vllm_kvreuse.beam.result import BeamOut, BeamResult
from vllm_kvreuse.core.request_keys import PARENT
from vllm_kvreuse.core.upstream import never_stop, share_block_hashes


@dataclass(slots=True)
class BeamGroup:
    """One beam search: its root request and the beams of the current step.

    ``previous`` are last step's beams: their KV is held until this step's
    beams (their children) have run, then released. ``live``: the beams'
    requests outlive a step (they are re-seated each step, :mod:`.live`);
    otherwise each step's beams are new requests of one token.
    """

    root: Request
    config: BeamConfig
    beams: list[Beam]
    results: dict[str, Row] = field(default_factory=dict)
    # Live members whose row of this step is in (they sit out schedules
    # until the step is taken).
    sampled: set[str] = field(default_factory=set)
    completed: list[BeamSearchSequence] = field(default_factory=list)
    previous: list[str] = field(default_factory=list)
    step: int = 0
    live: bool = False
    prefill_stats: Any = None
    # What a KV connector returned with the root's prefill (P/D): passed on
    # unchanged in the group's final output.
    kv_transfer_params: dict[str, Any] | None = None
    num_forks: int = 0
    num_copied_blocks: int = 0
    # Prompt tokens the beams computed. Their outputs never reach the
    # frontend, so vLLM's own prompt-token metrics do not see them.
    num_member_computed_tokens: int = 0

    @classmethod
    def start(cls, root: Request, config: BeamConfig) -> BeamGroup:
        """A group whose one beam is the root itself (its prompt)."""
        prompt = list(root.prompt_token_ids or [])
        seq = BeamSearchSequence(orig_prompt=None, tokens=prompt, logprobs=[])
        return cls(root=root, config=config, beams=[Beam(seq, root.request_id)])

    @property
    def root_id(self) -> str:
        return self.root.request_id

    @property
    def prompt_len(self) -> int:
        return self.root.num_prompt_tokens

    @property
    def beam_ids(self) -> list[str]:
        """Requests whose KV the group may hold: last step's and this step's."""
        return self.previous + [beam.request_id for beam in self.beams]

    def result(self, final: list[BeamSearchSequence]) -> BeamResult:
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
        )


def member_request(
    group: BeamGroup,
    tokens: list[int],
    parent_id: str,
    index: int,
    extra_args: dict[str, Any],
    hash_block_size: int,
    live: bool = False,
) -> Request:
    """The request of beam ``index`` of the group's next step.

    Its prompt is the beam's ``tokens``; it names ``parent_id``, whose held
    blocks it inherits (:mod:`vllm_kvreuse.core.ledger`), and computes one
    token. ``extra_args`` go next to the parent's name (catalog node).
    A ``live`` member runs until the group aborts it: it never stops on
    its own (no EOS, no stop tokens, a token budget for the whole search).
    """
    root = group.root
    assert root.sampling_params is not None
    # Shallow: members only read their params, and a deep copy per beam
    # per step was the largest cost of a step (as vLLM's own internal
    # beam search, which sets skip_clone).
    sampling = copy.copy(root.sampling_params)
    sampling.extra_args = {PARENT: parent_id, **extra_args}
    if live:
        sampling.max_tokens = group.config.max_tokens + 1
        never_stop(sampling)
    request = Request(
        request_id=f"{root.request_id}-beam{group.step}-{index}",
        prompt_token_ids=list(tokens),
        sampling_params=sampling,
        pooling_params=None,
        client_index=root.client_index,
        lora_request=root.lora_request,
        cache_salt=root.cache_salt,
        priority=root.priority,
    )
    # Every beam starts with the root's prompt: reuse its full-block
    # hashes and hash only the blocks past them.
    share_block_hashes(request, root, root.num_prompt_tokens // hash_block_size)
    return request
