"""What a chunked request's response says in its ``kv_transfer_params``.

The scheduler side notes it while the request runs and hands it to vLLM
when the request finishes (the connector's ``request_finished``), which
puts it in the response: the documents answer paths kept, the cap that
sent a request joint, and the engine steps its prefill took.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

    from vllm_kvreuse.chunk_cache.engine.stats import StoreStats

DOCUMENTS_KEPT = "kvreuse_documents_kept"
"""How many documents a request in ``paths`` or ``choose`` mode was
answered on."""
PATHS_CAPPED = "kvreuse_paths_capped"
"""Set for a ``paths`` or ``choose`` request run ``joint``, unscored, for
having more documents than the value (``--chunk-paths-max-documents``)."""
PREFILL_STEPS = "kvreuse_prefill_steps"
"""The engine steps a chunked request's prefill took, up to its first token
(a plain prefix hit takes one)."""


class Said:
    """Each chunked request's response fields, and its steps so far.

    ``steps`` holds a chunked request from its arrival until its prefill
    ends (or it finishes); ``said`` its fields until it finishes.
    """

    def __init__(self, stats: StoreStats) -> None:
        self._stats = stats
        self.steps: dict[str, int] = {}
        self._said: dict[str, dict[str, Any]] = {}

    def decided(self, request_id: str, kept: int) -> None:
        """Answer paths decided ``request_id`` on ``kept`` documents."""
        self._stats.decided += 1
        self._stats.documents_kept += kept
        self._said.setdefault(request_id, {})[DOCUMENTS_KEPT] = kept

    def capped(self, request_id: str, cap: int) -> None:
        """``request_id`` has more than ``cap`` documents: it runs joint."""
        self._stats.paths_capped += 1
        self._said.setdefault(request_id, {})[PATHS_CAPPED] = cap

    def count_steps(self, output: SchedulerOutput, requests: dict[str, Any]) -> None:
        """Counts a step for each chunked request ``output`` schedules before
        its first token; one whose prefill ends in it has its count kept."""
        scheduled = output.num_scheduled_tokens
        for request_id in [r for r in self.steps if r in scheduled]:
            self.steps[request_id] += 1
            request = requests.get(request_id)
            if request is None or request.is_prefill_chunk:
                continue
            steps = self.steps.pop(request_id)
            self._stats.prefill_steps += steps
            self._stats.prefilled += 1
            self._said.setdefault(request_id, {})[PREFILL_STEPS] = steps

    def take(self, request_id: str) -> dict[str, Any] | None:
        """The finished request's fields (None: nothing to say)."""
        self.steps.pop(request_id, None)
        return self._said.pop(request_id, None)
