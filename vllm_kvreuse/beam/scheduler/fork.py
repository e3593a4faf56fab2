"""Fork steps: one new request per beam per step, ranked on the host.

The step strategy of a group whose members cannot outlive a step: its
blocks cannot be handed over (not full attention, or no prefix caching).
Every step's beams are new one-token requests (spawned by the group table,
:meth:`.groups.GroupTable.spawn`) whose parents are held in the ledger;
each asks vLLM's sampler for the log-prob row its beam needs
(``BeamConfig.num_logprobs``), and the group's rule ranks the rows on the
host (:mod:`.group_rule`) once all are in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.engine import EngineCoreOutput

from vllm_kvreuse.beam.rule import Beam, Step, logprob_row

if TYPE_CHECKING:
    from vllm_kvreuse.beam.scheduler.group import BeamGroup
    from vllm_kvreuse.beam.scheduler.groups import GroupTable


class ForkSteps:
    """Spawns each step's beams as new requests; ranks their rows on the host."""

    def __init__(self, groups: GroupTable) -> None:
        self._groups = groups

    def record(self, group: BeamGroup, out: EngineCoreOutput) -> None:
        """One member's log-prob row (the step is in once all are:
        :meth:`BeamGroup.has_step`)."""
        logprobs = out.new_logprobs
        assert logprobs is not None
        group.rows[out.request_id] = logprob_row(
            logprobs.logprob_token_ids[0],
            logprobs.logprobs[0],
            group.config.num_logprobs,
        )

    def host_step(self, group: BeamGroup) -> tuple[Step, list[int]]:
        """The step the members' rows give (and each next beam's node)."""
        rows = [group.rows.pop(beam.request_id) for beam in group.beams]
        return group.rule.host_step(group.beams, rows, group.config)

    def start(self, group: BeamGroup, step: Step, nodes: list[int]) -> list[Beam]:
        """The next beams as new member requests."""
        args = group.rule.fork_args(nodes, group.config)
        return [
            Beam(
                seq,
                self._groups.spawn(
                    group, seq.tokens, parent_id, i, args[i] if args else {}
                ),
                nodes[i] if nodes else 0,
            )
            for i, (seq, parent_id) in enumerate(step.beams)
        ]

    apply = start  # every step's beams are new requests
