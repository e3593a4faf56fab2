"""What a feature is to the scheduler hook layer: a plain object with hooks.

A feature never subclasses ``Scheduler`` and never imports another feature.
It gets the :class:`~vllm_kvreuse.core.context.Core` (the scheduler, the
block ledger, internal requests, engine-made outputs) and implements the
hooks it needs; the layer calls only hooks a feature overrides.

Hooks come in two kinds (:data:`HOOKS`):
- ``broadcast``: every feature that implements it is called, in the order of
  :data:`vllm_kvreuse.features.SPECS`;
- ``exclusive``: at most one enabled feature may implement it (its answer is
  the answer); ``tests/unit/test_hook_layer.py`` fails if two do.

Per-request hooks must not raise for one request's bad data; if one does,
the layer fails that request alone (``FinishReason.ERROR``) and carries on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    from vllm_kvreuse.core.context import Core

HookKind = Literal["broadcast", "exclusive"]

HOOKS: dict[str, HookKind] = {
    "on_add": "broadcast",
    "on_preempt": "broadcast",
    "on_finish": "broadcast",
    "before_free_blocks": "broadcast",
    "on_abort": "broadcast",
    "before_schedule": "broadcast",
    "after_schedule": "broadcast",
    "filter_outputs": "broadcast",
    "on_internal_output": "broadcast",
    "release_under_pressure": "broadcast",
    "reset_cache": "broadcast",
    "extra_hit_tokens": "exclusive",
    "cap_new_tokens": "broadcast",
    "on_model_output": "broadcast",
    "waiting_summary": "broadcast",
}
"""Every hook, by kind; the layer calls them in this vocabulary only."""


class Feature:
    """Base of every feature: each hook is a no-op until overridden."""

    name: ClassVar[str] = ""

    def __init__(self, core: Core) -> None:
        self.core = core

    # -- requests --------------------------------------------------------------

    def on_add(self, request: Request) -> None:
        """A new client request, before upstream queues it (hashes may change).

        Internal requests (:mod:`vllm_kvreuse.core.internal`) never come here.
        """

    def on_preempt(self, request: Request) -> None:
        """``request`` was just preempted: it holds no blocks now."""

    def on_finish(self, request: Request) -> None:
        """``request`` finished or was aborted; its blocks are still its own.

        Called for every request, internal ones too.
        """

    def before_free_blocks(self, request: Request) -> None:
        """``request``'s blocks are about to return to the pool; a feature may
        keep them with ``core.ledger.hold``."""

    def on_abort(self, request_ids: set[str]) -> None:
        """Requests finished from outside (client abort), before upstream
        finishes them; ids may be unknown."""

    def extra_hit_tokens(self, request: Request, num_local: int) -> int | None:
        """Tokens past ``num_local`` (its local hit) whose KV this feature will
        supply without computing them; None if the feature has no say."""
        return None

    def cap_new_tokens(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        """How many of the ``num_new_tokens`` upstream would schedule for
        ``request`` from ``num_computed_tokens`` it may compute this step (a
        smaller number splits its prefill there); 0 skips it this step. The
        least of every feature's answer counts."""
        return num_new_tokens

    # -- steps -----------------------------------------------------------------

    def before_schedule(self) -> None:
        """Start of a step, before upstream schedules."""

    def after_schedule(self, output: SchedulerOutput) -> None:
        """Upstream built ``output``; the step is not run yet (blocks in it
        must not be freed)."""

    def on_model_output(
        self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput
    ) -> None:
        """The workers' output of ``scheduler_output``, before upstream reads it."""

    def filter_outputs(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        """The step's outputs to clients; a feature may take some out."""

    def on_internal_output(self, output: EngineCoreOutput) -> None:
        """An output of an internal request this feature spawned."""

    def release_under_pressure(self) -> bool:
        """The step preempted, or admitted nothing while requests waited:
        let go of the oldest thing held. True if something was released."""
        return False

    def reset_cache(self) -> None:
        """``reset_prefix_cache``: drop what is kept only as cache."""

    def waiting_summary(self) -> dict[str, Any]:
        """What this feature makes requests wait for (logged on a stall)."""
        return {}


def implements(feature: Feature, hook: str) -> bool:
    """Whether ``feature``'s class overrides ``hook``."""
    return getattr(type(feature), hook) is not getattr(Feature, hook)
