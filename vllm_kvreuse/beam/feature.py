"""Beam search inside the engine, beams forking their parent's KV blocks.

A beam group starts from one root request (``extra_args["kvreuse_beam"]``)
that the frontend sends instead of one request per beam per step. The
root's prefill gives the first log-prob row; the first beams are internal
requests (:mod:`vllm_kvreuse.core.internal`) naming the root
(``kvreuse_parent``), so the core layer hands them its blocks (full blocks
by reference, the partial tail copy-on-write). From then on the members
live (:mod:`.live`): each step every member decodes one token, the rows
feed :func:`vllm_kvreuse.beam.policy.expand`, and members are re-seated
onto the beams they carry next. Where blocks cannot be handed over (not
full attention, no prefix caching) or the width exceeds the running seats,
each step's beams are new one-token requests instead.

Block ownership: live members own their blocks as any running request
(re-seats move references, :mod:`vllm_kvreuse.core.reseat`); a beam forked
as a new request has its parent held in the ledger (owner ``beam``) until
the step after next is selected. Under memory pressure the oldest group's
held blocks are released (then its members use the prefix cache), else the
oldest group's members that wait for a sibling are preempted, so beams can
never deadlock the queue. ``reset_prefix_cache`` releases every held beam.
When the group ends, fails or is aborted, everything it holds is released
and its members are aborted.

Admission: a step is admitted whole (:mod:`.gate`). Outputs: the root's and
members' outputs never reach the client; the root's client gets one final
output whose ``stop_reason`` carries the best beams (:mod:`.result`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import Request, RequestStatus

from vllm_kvreuse.beam import result as beam_result
from vllm_kvreuse.beam.catalog_policy import catalog_args, catalog_step
from vllm_kvreuse.beam.catalog_setup import engine_catalog
from vllm_kvreuse.beam.gate import steps_that_do_not_fit
from vllm_kvreuse.beam.group import BeamGroup, member_request
from vllm_kvreuse.beam.live import carriers, stalled, to_hold, with_catalog_args
from vllm_kvreuse.beam.policy import Beam, BeamConfig, best, expand, logprob_row
from vllm_kvreuse.core.feature import Feature
from vllm_kvreuse.core.reseat import Move

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
        self._held: list[Request] = []  # live members out of this schedule
        # The SID catalog (--sid-catalog), on CPU: the scheduler walks it.
        self.catalog = engine_catalog(core.scheduler.vllm_config, "cpu")
        self._upstream = core.upstream
        self._hash_block_size = core.upstream.hash_block_size

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
        if not self._groups:
            return
        upstream = self._upstream
        self._parked = steps_that_do_not_fit(upstream, self._groups, self._member_group)
        upstream.park(self._parked)
        self._held = to_hold(upstream, self._member_group)
        upstream.hold(self._held)

    def after_schedule(self, output: SchedulerOutput) -> None:
        if self._parked:  # back at the head, in their order
            self._upstream.unpark(self._parked)
            self._parked = []
        if self._held:
            self._upstream.put_back(self._held)
            self._held = []

    def on_preempt(self, request: Request) -> None:
        """A live member preempted after sampling forgets that row: it
        resumes from its beam's tokens and samples the same position again."""
        group = self._member_group.get(request.request_id)
        if group is None or request.request_id not in group.sampled:
            return
        group.sampled.discard(request.request_id)
        group.results.pop(request.request_id, None)
        self._upstream.unsample(request)

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
        slower) instead of waiting forever. Else live members that wait for
        a sibling that cannot run may hold the blocks or seats it needs: the
        oldest such group's are preempted (they recompute their step later)."""
        ledger = self.core.ledger
        for group in self._groups.values():
            if any(beam_id in ledger for beam_id in group.beam_ids):
                self._release_held(group.beam_ids)
                return True
        requests = self.core.scheduler.requests
        for group in self._groups.values():
            if group.live and (stuck := stalled(requests, group)):
                self._upstream.preempt(stuck)
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
        if group is None:
            return False
        if out.finish_reason is None:  # a live member's step
            if group.live and out.new_logprobs is not None:
                group.sampled.add(out.request_id)
                self._record(group, out)
            return True
        del self._member_group[out.request_id]
        group.sampled.discard(out.request_id)
        is_root = out.request_id == group.root.request_id
        failed = out.finish_reason not in _OK or out.new_logprobs is None
        if failed or group.live:  # a live member never finishes on its own
            self._drop(group)
            if is_root:
                return False  # the engine's own answer: pass it on
            reason = out.finish_reason if failed else FinishReason.ERROR
            self._emit(group, reason, None, stop_reason=out.stop_reason)
            return True
        if is_root:
            group.prefill_stats = out.prefill_stats
            group.kv_transfer_params = out.kv_transfer_params  # a connector's
        self._record(group, out)
        return True

    def _record(self, group: BeamGroup, out: EngineCoreOutput) -> None:
        """One beam's log-prob row; the group is ready when all are in."""
        if out.request_id != group.root_id:  # a live step computes one token
            stats = out.prefill_stats
            group.num_member_computed_tokens += (
                stats.num_computed_tokens if stats is not None else 1
            )
        logprobs = out.new_logprobs
        assert logprobs is not None
        group.results[out.request_id] = logprob_row(
            logprobs.logprob_token_ids[0],
            logprobs.logprobs[0],
            group.config.num_logprobs,
        )
        if len(group.results) == len(group.beams):
            self._ready[group.root.request_id] = group

    def _advance(self, group: BeamGroup) -> None:
        """Selects the next beams; spawns their requests or ends the group."""
        if group.root.request_id not in self._groups:
            return  # dropped meanwhile
        rows = [group.results.pop(beam.request_id) for beam in group.beams]
        group.sampled.difference_update(beam.request_id for beam in group.beams)
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
        extra = catalog_args(self.catalog, group.config, nodes) if nodes else None
        if group.live:
            group.beams = self._reseat(group, step.beams, nodes, extra)
            return
        group.beams = [
            Beam(
                seq,
                self._spawn(group, seq.tokens, parent_id, i, extra[i] if extra else {}),
                nodes[i] if nodes else 0,
            )
            for i, (seq, parent_id) in enumerate(step.beams)
        ]
        group.live = self._can_live(group)

    def _can_live(self, group: BeamGroup) -> bool:
        """Members can outlive a step: blocks can be handed over, and the
        whole width fits the running seats at once."""
        seats = self._upstream.seat_limit()
        return self.core.ledger.enabled and group.config.width <= seats

    def _reseat(
        self,
        group: BeamGroup,
        beams: list[tuple[Any, str]],
        nodes: list[int],
        extra: list[dict[str, int]] | None,
    ) -> list[Beam]:
        """Carries the next beams on the live members (:mod:`.live`)."""
        requests = self.core.scheduler.requests
        reseats = self.core.reseats
        rows, spares = carriers(
            [beam.request_id for beam in group.beams], [pid for _, pid in beams]
        )
        # Every seat is read before any member changes.
        seats = {
            pid: reseats.seat_of(requests[pid])
            for (_, pid), rid in zip(beams, rows, strict=True)
            if rid is None
        }
        spares.reverse()  # popped from the end: beam order
        moves: list[Move] = []
        next_beams: list[Beam] = []
        for i, ((seq, pid), rid) in enumerate(zip(beams, rows, strict=True)):
            token = seq.tokens[-1]
            if rid is None and not spares:  # more beams than members: fork
                if pid not in self.core.ledger:
                    self.core.ledger.hold(requests[pid], OWNER)
                rid = self._spawn(
                    group, seq.tokens, pid, i, extra[i] if extra else {}, live=True
                )
            else:
                request = requests[rid] if rid is not None else requests[spares.pop()]
                params = with_catalog_args(request, extra[i]) if extra else None
                if rid is None:
                    moves.append(Move(request, seats[pid], token, params))
                    group.num_forks += 1
                elif request.all_token_ids[-1] != token or params is not None:
                    moves.append(Move(request, None, token, params))
                rid = request.request_id
            next_beams.append(Beam(seq, rid, nodes[i] if nodes else 0))
        copied = reseats.num_copied_blocks
        reseats.move(moves)
        group.num_copied_blocks += reseats.num_copied_blocks - copied
        for rid in spares:  # fewer beams than members
            self._member_group.pop(rid, None)
        self.core.abort(spares)
        return next_beams

    def _spawn(
        self,
        group: BeamGroup,
        tokens: list[int],
        parent_id: str,
        index: int,
        catalog_args: dict[str, int],
        live: bool | None = None,
    ) -> str:
        """Adds the request of one beam of the next step; returns its id."""
        request = member_request(
            group,
            tokens,
            parent_id,
            index,
            catalog_args,
            self._hash_block_size,
            live=self._can_live(group) if live is None else live,
        )
        group.num_forks += 1
        group.num_copied_blocks += bool((len(tokens) - 1) % self.core.block_size)
        self._member_group[request.request_id] = group
        self.core.internal.spawn(request, self)
        return request.request_id

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
