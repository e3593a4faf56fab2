"""Running requests sent whole to the workers again.

A feature that changes a *running* request's computed state on the
scheduler side (the chunk cache moves a request's computed count; a beam
member's sample taken back) must tell the workers, whose copy is now stale.
vLLM 0.32 has a way to replace a known request's whole state: a
*streaming input update*, the same request id sent again in
``scheduled_new_reqs``; both runners then replace its cached state (tokens,
blocks, computed count, sampling params) and re-add its row (V1
``GPUModelRunner._update_streaming_request``, V2 ``add_requests``). So no
runner is patched: :meth:`Resends.deliver` moves each such request from the
step's ``scheduled_cached_reqs`` to ``scheduled_new_reqs`` the first time it
is scheduled after the change. As in a streaming update, the whole history
is the request's prompt.

Invariant: a request marked here must not be scheduled without
:meth:`Resends.deliver` running on that step's output (the hook layer calls
it after every schedule).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request, RequestStatus

if TYPE_CHECKING:
    from vllm_kvreuse.core.upstream.scheduler import Upstream


class Resends:
    """Requests whose workers' copy is stale, and their delivery."""

    def __init__(self, upstream: Upstream) -> None:
        self._upstream = upstream
        self.pending: set[str] = set()
        """Requests whose workers have not been told yet."""

    def resend(self, request_id: str) -> None:
        """The workers' copy of a running request is stale (a feature moved
        its computed count): send it whole the next time it is scheduled."""
        self.pending.add(request_id)

    def rewind(self, request: Request) -> None:
        """Takes back the request's last sample (the token, and the hash of a
        block it completed); running, also the position that computed it,
        which its next step computes again: its whole history becomes its
        prompt, one token short of computed, and it is sent whole."""
        upstream = self._upstream
        upstream.unsample(request)
        if request.status != RequestStatus.RUNNING:
            return  # preempted: it recomputes from its tokens
        tokens = list(request.all_token_ids)
        computed = min(request.num_computed_tokens, len(tokens) - 1)
        hashes = request.block_hashes[: computed // upstream.hash_block_size]
        upstream.retoken(request, tokens, computed, hashes, None)
        self.pending.add(request.request_id)

    def deliver(self, output: SchedulerOutput) -> None:
        """Sends each scheduled marked request to its workers as a streaming
        update (a ``NewRequestData`` for an id they know)."""
        if self.pending:
            self.pending -= self._upstream.send_whole(output, self.pending)

    def forget(self, request_id: str) -> None:
        self.pending.discard(request_id)
