"""Beam search inside the engine, beams forking their parent's KV blocks.

A beam group starts from one root request (``extra_args["kvreuse_beam"]``)
that the frontend sends instead of one request per beam per step. Each step,
every live beam is one internal request (:mod:`vllm_kvreuse.core.internal`)
of ``max_tokens=1`` whose prompt is the beam's tokens; it names its parent
beam (``kvreuse_parent``), so the core layer hands it the parent's blocks
(full blocks by reference, the partial tail copy-on-write) and it computes
one token. Its log-probs feed :func:`vllm_kvreuse.beam.policy.expand`; the
next step's beams are spawned inside the engine, with no frontend round trip.

Block ownership:
- When a beam's request finishes, the ledger holds its computed blocks for
  the group (owner ``beam``) until its children have run, i.e. until the
  step after next is selected; beams that die are released then too.
- Under memory pressure the oldest group's held blocks are released, so held
  beams can never deadlock the queue; its members then use the prefix cache.
- ``reset_prefix_cache`` releases every group's held blocks: with
  ``reset_running_requests`` vLLM requires the whole pool free afterwards
  and raises otherwise; waiting members then compute their prompts.
- When the group ends, fails or is aborted, everything it holds is released
  and its live members are aborted.

Admission: a step is admitted whole (:mod:`.gate`).

Outputs: the root's output and members' outputs never reach the client; the
root's client gets one final output whose ``stop_reason`` carries the best
beams (:mod:`.result`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import Request, RequestStatus

from vllm_kvreuse.beam import result as beam_result
from vllm_kvreuse.beam.catalog_policy import catalog_step
from vllm_kvreuse.beam.catalog_setup import LEAF_EOS_KEY, NODE_KEY, engine_catalog
from vllm_kvreuse.beam.gate import park_steps_that_do_not_fit
from vllm_kvreuse.beam.group import BeamGroup, member_request
from vllm_kvreuse.beam.policy import Beam, BeamConfig, best, expand, logprob_row
from vllm_kvreuse.core.feature import Feature

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

    from vllm_kvreuse.core.context import Core

OWNER = "beam"
_DONE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
_OK = (FinishReason.STOP, FinishReason.LENGTH)


class EngineBeamSearch(Feature):
    """Runs beam groups; members are internal requests to upstream's loop."""

    name = "beam"

    def __init__(self, core: Core) -> None:
        super().__init__(core)
        self._groups: dict[str, BeamGroup] = {}  # by root id, oldest first
        self._member_group: dict[str, BeamGroup] = {}  # live members and roots
        self._ready: dict[str, BeamGroup] = {}
        self._parked: list[Request] = []
        # The SID catalog (--sid-catalog), on CPU: the scheduler walks it.
        self.catalog = engine_catalog(core.scheduler.vllm_config, "cpu")

    # -- requests --------------------------------------------------------------

    def on_add(self, request: Request) -> None:
        sampling = request.sampling_params
        config = BeamConfig.from_extra_args(sampling.extra_args if sampling else None)
        if config is None:
            return
        if config.sid_catalog and self.catalog is None:
            raise ValueError(
                "sid_catalog beams need a server started with --sid-catalog"
            )
        group = BeamGroup.start(request, config)
        self._groups[request.request_id] = group
        self._member_group[request.request_id] = group

    def before_free_blocks(self, request: Request) -> None:
        if request.request_id in self._member_group and request.status in _DONE:
            self.core.ledger.hold(request, OWNER)

    def on_finish(self, request: Request) -> None:
        """A root or member that ends otherwise than by its one step ends its
        group; the root's client is told unless it went away or was already
        answered (a rejection)."""
        group = self._member_group.get(request.request_id)
        if group is None or request.status in _DONE:
            return
        is_root = request.request_id == group.root.request_id
        self._drop(group)
        if not is_root and request.status != RequestStatus.FINISHED_ABORTED:
            self._emit(group, FinishReason.ERROR, None)

    def on_abort(self, request_ids: set[str]) -> None:
        """A client abort of a root whose first step is over ends its group."""
        for root_id in request_ids & self._groups.keys():
            if root_id not in self.core.scheduler.requests:
                self._drop(self._groups[root_id])

    # -- steps -----------------------------------------------------------------

    def before_schedule(self) -> None:
        if self._groups:
            self._parked = park_steps_that_do_not_fit(
                self.core.scheduler, self._groups, self._member_group
            )

    def after_schedule(self, output: SchedulerOutput) -> None:
        if self._parked:  # back at the head, in their order
            self.core.scheduler.waiting.prepend_requests(reversed(self._parked))
            self._parked = []

    def on_internal_output(self, output: EngineCoreOutput) -> None:
        self._take(output)

    def filter_outputs(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        if self._groups:
            for engine_outputs in outputs.values():
                engine_outputs.outputs = [
                    out
                    for out in engine_outputs.outputs
                    if out.request_id not in self._groups or not self._take(out)
                ]
        ready, self._ready = self._ready, {}
        for group in ready.values():
            try:
                self._advance(group)
            except Exception as e:  # one group's failure is that group's
                self._drop(group)
                self.core.fail(group.root.request_id, f"beam step failed: {e}")

    def release_under_pressure(self) -> bool:
        """Held beams may be what blocks the queue's head: let the oldest
        group's go. Its waiting members then use the prefix cache (correct,
        slower) instead of waiting forever."""
        ledger = self.core.ledger
        for group in self._groups.values():
            if any(beam_id in ledger for beam_id in group.beam_ids):
                self._release_held(group.beam_ids)
                return True
        return False

    def reset_cache(self) -> None:
        for group in self._groups.values():
            self._release_held(group.beam_ids)

    def waiting_summary(self) -> dict[str, int]:
        return {
            "groups": len(self._groups),
            "parked_members": len(self._parked),
            "held_beam_blocks": self.core.ledger.num_blocks(OWNER),
        }

    # -- group steps -----------------------------------------------------------

    def _take(self, out: EngineCoreOutput) -> bool:
        """Consumes a root's or member's output; True if it must not reach
        the client."""
        group = self._member_group.get(out.request_id)
        if group is None or out.finish_reason is None:
            return group is not None
        del self._member_group[out.request_id]
        is_root = out.request_id == group.root.request_id
        if out.finish_reason not in _OK or out.new_logprobs is None:
            self._drop(group)
            if is_root:
                return False  # the engine's own answer: pass it on
            self._emit(group, out.finish_reason, None, stop_reason=out.stop_reason)
            return True
        if is_root:
            group.prefill_stats = out.prefill_stats
            group.kv_transfer_params = out.kv_transfer_params  # a connector's
        elif out.prefill_stats is not None:
            group.num_member_computed_tokens += out.prefill_stats.num_computed_tokens
        logprobs = out.new_logprobs
        group.results[out.request_id] = logprob_row(
            logprobs.logprob_token_ids[0], logprobs.logprobs[0], group.config.width
        )
        if len(group.results) == len(group.beams):
            self._ready[group.root.request_id] = group
        return True

    def _advance(self, group: BeamGroup) -> None:
        """Selects the next beams; spawns their requests or ends the group."""
        if group.root.request_id not in self._groups:
            return  # dropped meanwhile
        rows = [group.results.pop(beam.request_id) for beam in group.beams]
        nodes: list[int] = []
        if group.config.sid_catalog:
            assert self.catalog is not None
            constrained = catalog_step(self.catalog, group.beams, rows, group.config)
            step, nodes = constrained.step, constrained.nodes
        else:
            step = expand(group.beams, rows, group.config)
        group.completed += step.completed
        group.step += 1
        # The previous step's beams have been forked from: their KV can go.
        self._release_held(group.previous)
        group.previous = [beam.request_id for beam in group.beams]
        if group.step >= group.config.max_tokens or not step.beams:
            final = best(group.completed, [seq for seq, _ in step.beams], group.config)
            self._emit(group, FinishReason.STOP, final)
            self._drop(group)
            return
        # A catalog beam carries its trie node (and, at an item, its EOS).
        extra = self._catalog_args(group.config, nodes) if nodes else None
        group.beams = [
            Beam(
                seq,
                self._spawn(group, seq.tokens, parent_id, i, extra[i] if extra else {}),
                nodes[i] if nodes else 0,
            )
            for i, (seq, parent_id) in enumerate(step.beams)
        ]

    def _spawn(
        self,
        group: BeamGroup,
        tokens: list[int],
        parent_id: str,
        index: int,
        catalog_args: dict[str, int],
    ) -> str:
        """Adds the request of one beam of the next step; returns its id."""
        scheduler = self.core.scheduler
        hash_block_size = scheduler.cache_config.hash_block_size or self.core.block_size
        request = member_request(
            group, tokens, parent_id, index, catalog_args, hash_block_size
        )
        group.num_forks += 1
        group.num_copied_blocks += bool((len(tokens) - 1) % self.core.block_size)
        self._member_group[request.request_id] = group
        self.core.internal.spawn(request, self)
        return request.request_id

    def _catalog_args(
        self, config: BeamConfig, nodes: list[int]
    ) -> list[dict[str, int]]:
        """What the logits processor needs to mask each next beam's row."""
        assert self.catalog is not None
        eos = config.eos_token_id
        if eos is None or config.ignore_eos:
            return [{NODE_KEY: node} for node in nodes]
        leaves = self.catalog.is_leaf(torch.tensor(nodes, dtype=torch.long)).tolist()
        return [
            {NODE_KEY: node, LEAF_EOS_KEY: eos} if leaf else {NODE_KEY: node}
            for node, leaf in zip(nodes, leaves, strict=True)
        ]

    def _emit(
        self,
        group: BeamGroup,
        finish_reason: FinishReason,
        final: list[Any] | None,
        stop_reason: int | str | None = None,
    ) -> None:
        """The root's one and only output to its client: with ``final``
        beams, their result in the stop reason; else the engine's answer."""
        if final is not None:
            stop_reason = beam_result.encode(group.result(final))
        self.core.emit(
            group.root.client_index,
            EngineCoreOutput(
                request_id=group.root.request_id,
                new_token_ids=[],
                finish_reason=finish_reason,
                stop_reason=stop_reason,
                kv_transfer_params=group.kv_transfer_params,
                prefill_stats=group.prefill_stats,
            ),
        )

    def _drop(self, group: BeamGroup) -> None:
        """Forgets ``group``: aborts its live members, releases what it holds."""
        if self._groups.pop(group.root.request_id, None) is None:
            return
        self._ready.pop(group.root.request_id, None)
        live = [rid for rid, owner in self._member_group.items() if owner is group]
        for request_id in live:
            del self._member_group[request_id]
        self._release_held(group.beam_ids)
        self.core.abort(r for r in live if r != group.root.request_id)

    def _release_held(self, request_ids: list[str]) -> None:
        self.core.ledger.release(request_ids)
