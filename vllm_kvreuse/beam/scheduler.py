"""Scheduler mixin: beam search inside the engine, beams forking their parent's KV.

A beam group starts from one root request (``extra_args["kvreuse_beam"]``)
that the frontend sends instead of one request per beam per step. Each step,
every live beam is one engine request of ``max_tokens=1`` whose prompt is the
beam's tokens; it names the request of its parent beam
(``extra_args["kvreuse_parent"]``), so it inherits the parent's blocks (full
blocks by reference, the partial tail copy-on-write, see
:mod:`vllm_kvreuse.continuation.scheduler`) and computes one token. Its
sampled log-probs feed :func:`vllm_kvreuse.beam.policy.expand`; the next
step's beams are spawned inside the engine, with no frontend round trip.

Block ownership:
- When a beam's request finishes, the group holds one reference on its
  computed blocks (``_held``) until its children have run, i.e. until the
  step after next is selected; beams that die are released then too.
- Under memory pressure (a step that preempted, or admitted nothing while
  requests wait) the oldest group's held blocks are released, so held beams
  can never deadlock the queue; its members then use the prefix cache.
- When the group ends, or is aborted, everything it holds is released and
  its live member requests are aborted.

Outputs: members' outputs never reach the frontend; the root's frontend
request gets one final output whose ``kv_transfer_params["kvreuse_beams"]``
lists the best beams.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm.entrypoints.generate.beam_search.utils import BeamSearchSequence
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from vllm_kvreuse.beam.policy import (
    Beam,
    BeamConfig,
    best,
    expand,
    logprob_row,
)
from vllm_kvreuse.continuation import params
from vllm_kvreuse.continuation.retention import RetainedParent
from vllm_kvreuse.continuation.scheduler import ContinuationMixin

RESULT_KEY = "kvreuse_beams"
_DONE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


@dataclass(slots=True)
class BeamGroup:
    """One beam search: its root request and the beams of the current step."""

    root: Request
    config: BeamConfig
    beams: list[Beam]
    results: dict[str, dict[int, float]] = field(default_factory=dict)
    completed: list[Any] = field(default_factory=list)
    previous: list[str] = field(default_factory=list)
    step: int = 0
    prefill_stats: Any = None
    num_forks: int = 0
    num_copied_blocks: int = 0
    # Prompt tokens the beams computed. Their outputs never reach the
    # frontend, so vLLM's own prompt-token metrics do not see them.
    num_member_computed_tokens: int = 0

    @property
    def prompt_len(self) -> int:
        return self.root.num_prompt_tokens


class BeamSearchMixin(ContinuationMixin):
    """Runs beam groups; members are ordinary requests to upstream's loop."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._groups: dict[str, BeamGroup] = {}
        self._member_group: dict[str, BeamGroup] = {}
        self._held: dict[str, RetainedParent] = {}

    # -- upstream hooks -------------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        parked = self._park_groups_that_do_not_fit()
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            if parked:  # back at the head, in their order
                self.waiting.prepend_requests(reversed(parked))
        if self._held and self._under_memory_pressure(output):
            # Held beams may be what blocks the queue's head: let the oldest
            # group's go. Its waiting members then fall back to the prefix
            # cache (correct, slower) instead of waiting forever.
            group = next(g for g in self._groups.values() if self._holds(g))
            self._release_held(group.previous + [b.request_id for b in group.beams])
        return output

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        sampling = request.sampling_params
        config = BeamConfig.from_extra_args(sampling.extra_args if sampling else None)
        if config is not None and request.request_id not in self._groups:
            prompt = list(request.prompt_token_ids or [])
            root_beam = Beam(
                BeamSearchSequence(orig_prompt=None, tokens=prompt, logprobs=[]),
                request.request_id,
            )
            group = BeamGroup(root=request, config=config, beams=[root_beam])
            self._groups[request.request_id] = group
            self._member_group[request.request_id] = group

    def _free_blocks(self, request: Request) -> None:
        if request.request_id in self._member_group and request.status in _DONE:
            entry = self._hold(request, float("inf"))
            if entry is not None:
                self._held[request.request_id] = entry
        super()._free_blocks(request)

    def _parent_entry(self, parent_id: str) -> RetainedParent | None:
        return self._held.get(parent_id) or super()._parent_entry(parent_id)

    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> list[Request]:
        """Aborting a root aborts its whole group, whatever step it is at."""
        if request_ids is not None and not isinstance(request_ids, str):
            request_ids = list(request_ids)  # read twice below
        if request_ids is not None and self._groups:
            ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
            for root_id in ids & self._groups.keys():
                if root_id not in self.requests:
                    self._drop(self._groups[root_id])
        return super().finish_requests(request_ids, finished_status)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if not self._member_group:
            return outputs
        ready: list[BeamGroup] = []
        for engine_outputs in outputs.values():
            engine_outputs.outputs = [
                out
                for out in engine_outputs.outputs
                if not self._take_member_output(out, ready, outputs)
            ]
        for group in ready:
            self._advance(group, outputs)
        return outputs

    # -- group admission --------------------------------------------------------

    def _park_groups_that_do_not_fit(self) -> list[Request]:
        """Takes out of the queue, for this step, every waiting member of a
        group whose step does not fit the free blocks as a whole.

        A member inherits its parent's blocks and needs one new block (its
        copy-on-write tail), so a step of ``k`` waiting members needs ``k``
        free blocks. Admitting a step whole means no member holds blocks
        while its siblings wait for them; groups are considered oldest first.
        A step that admits nothing counts as memory pressure, which releases
        the oldest group's held beams, so parking can never deadlock.
        """
        if not self._groups or not self.waiting:
            return []
        waiting: dict[str, list[Request]] = {}  # root id -> waiting members
        for request in self.waiting:
            group = self._member_group.get(request.request_id)
            if group is not None and request.request_id != group.root.request_id:
                waiting.setdefault(group.root.request_id, []).append(request)
        if not waiting:
            return []
        free = self.kv_cache_manager.block_pool.get_num_free_blocks()
        parked: list[Request] = []
        for root_id in self._groups:  # oldest first
            members = waiting.get(root_id)
            if not members:
                continue
            if len(members) <= free:
                free -= len(members)
            else:
                parked += members
        if parked:
            self.waiting.remove_requests(parked)
        return parked

    # -- group steps -----------------------------------------------------------

    def _take_member_output(
        self,
        out: EngineCoreOutput,
        ready: list[BeamGroup],
        outputs: dict[int, EngineCoreOutputs],
    ) -> bool:
        """Consumes a member's output; True if it must not reach the frontend."""
        group = self._member_group.get(out.request_id)
        if group is None or out.finish_reason is None:
            return group is not None
        del self._member_group[out.request_id]
        is_root = out.request_id == group.root.request_id
        if out.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH) or (
            out.new_logprobs is None
        ):
            self._drop(group)
            if is_root:
                return False  # e.g. a cache-threshold rejection: pass it on
            self._emit(
                group, outputs, out.finish_reason, None, stop_reason=out.stop_reason
            )
            return True
        if is_root:
            group.prefill_stats = out.prefill_stats
        elif out.prefill_stats is not None:
            group.num_member_computed_tokens += out.prefill_stats.num_computed_tokens
        logprobs = out.new_logprobs
        group.results[out.request_id] = logprob_row(
            logprobs.logprob_token_ids[0].tolist(),
            logprobs.logprobs[0].tolist(),
            group.config.width,
        )
        if len(group.results) == len(group.beams):
            ready.append(group)
        return True

    def _advance(self, group: BeamGroup, outputs: dict[int, EngineCoreOutputs]) -> None:
        """Selects the next beams; spawns their requests or ends the group."""
        rows = [group.results.pop(beam.request_id) for beam in group.beams]
        step = expand(group.beams, rows, group.config)
        group.completed += step.completed
        group.step += 1
        # The previous step's beams have been forked from: their KV can go.
        self._release_held(group.previous)
        group.previous = [beam.request_id for beam in group.beams]
        if group.step >= group.config.max_tokens or not step.beams:
            final = best(group.completed, [seq for seq, _ in step.beams], group.config)
            self._emit(group, outputs, FinishReason.STOP, final)
            self._drop(group)
            return
        group.beams = [
            Beam(seq, self._spawn(group, seq.tokens, parent_id, i))
            for i, (seq, parent_id) in enumerate(step.beams)
        ]

    def _spawn(
        self, group: BeamGroup, tokens: list[int], parent_id: str, index: int
    ) -> str:
        """Adds the request of one beam of the next step; returns its id."""
        root = group.root
        assert root.sampling_params is not None
        # Shallow: members only read their params, and a deep copy per beam
        # per step was the largest cost of a step (as vLLM's own internal
        # beam search, which sets skip_clone).
        sampling = copy.copy(root.sampling_params)
        sampling.extra_args = {params.PARENT: parent_id}
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
        # hashes and hash only the blocks past them (hashes chain, so the
        # hasher continues from the last one).
        hash_block_size = self.cache_config.hash_block_size or self.block_size
        request.block_hashes = root.block_hashes[
            : root.num_prompt_tokens // hash_block_size
        ]
        request._block_hasher = root._block_hasher
        request.update_block_hashes()
        group.num_forks += 1
        group.num_copied_blocks += bool((len(tokens) - 1) % self.block_size)
        self._member_group[request.request_id] = group
        self.add_request(request)
        return request.request_id

    def _emit(
        self,
        group: BeamGroup,
        outputs: dict[int, EngineCoreOutputs],
        finish_reason: FinishReason,
        beams: list[Any] | None,
        stop_reason: int | str | None = None,
    ) -> None:
        """The root's one and only output to the frontend."""
        result = None
        if beams is not None:
            result = {
                RESULT_KEY: [
                    {
                        "token_ids": seq.tokens[group.prompt_len :],
                        "cum_logprob": seq.cum_logprob,
                        "finish_reason": seq.finish_reason or "length",
                        "stop_reason": seq.stop_reason,
                    }
                    for seq in beams
                ],
                "forks": group.num_forks,
                "copied_blocks": group.num_copied_blocks,
                "member_computed_tokens": group.num_member_computed_tokens,
            }
        out = EngineCoreOutput(
            request_id=group.root.request_id,
            new_token_ids=[],
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            kv_transfer_params=result,
            prefill_stats=group.prefill_stats,
        )
        outputs.setdefault(group.root.client_index, EngineCoreOutputs()).outputs.append(
            out
        )

    def _drop(self, group: BeamGroup) -> None:
        """Forgets ``group``: aborts its live members, releases what it holds."""
        self._groups.pop(group.root.request_id, None)
        live = [
            request_id
            for request_id, owner in self._member_group.items()
            if owner is group
        ]
        for request_id in live:
            del self._member_group[request_id]
        self._release_held(group.previous + [b.request_id for b in group.beams])
        if live:
            super().finish_requests(live, RequestStatus.FINISHED_ABORTED)
            self._release_held(live)

    def _holds(self, group: BeamGroup) -> bool:
        ids = group.previous + [beam.request_id for beam in group.beams]
        return any(request_id in self._held for request_id in ids)

    def _release_held(self, request_ids: Iterable[str]) -> None:
        entries = [entry for rid in request_ids if (entry := self._held.pop(rid, None))]
        self._release(entries)
        # Released after this step's stats were made: let one more step
        # publish the new KV usage.
        self._publish_release = self._publish_release or bool(entries)
