"""Requests the plugin adds to the engine for its own work.

Engine beam search adds its beams' requests (a live group's members for
the whole search, or one request per beam per step), answer paths one
scoring request per document of a chunked request. Each is derived from a
client's request (:func:`derived_request`: the client's index, LoRA
adapter, cache salt and priority). They are ordinary vLLM requests to
upstream's loop, with three exceptions that this service owns:
- they are exempt from admission (the admission check never judges one);
- their outputs never reach a client: each is taken out of the step's
  outputs and handed to the feature that spawned it;
- they are invisible to other features' ``on_add``.

Invariant: an id is in :attr:`owners` from :meth:`spawn` until the step
after it is freed: a request freed while upstream processes a step still has
its final output in that step's outputs, so :meth:`retire` only marks it and
:meth:`route` (or the next :meth:`drop_retired`) forgets it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import Request

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams


def derived_request(
    client: Request,
    request_id: str,
    prompt_token_ids: list[int],
    sampling_params: SamplingParams,
    block_hasher: Callable[[Request], list[Any]] | None = None,
) -> Request:
    """A request the plugin runs for ``client``'s request: on its behalf
    (its client index), with its LoRA adapter, cache salt and priority, so
    it computes and caches KV the client's request could use. Hashes its
    blocks with ``block_hasher`` (None: none yet; the caller sets them)."""
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=sampling_params,
        pooling_params=None,
        client_index=client.client_index,
        lora_request=client.lora_request,
        cache_salt=client.cache_salt,
        priority=client.priority,
        block_hasher=block_hasher,
    )


class Spawner(Protocol):
    """Who spawns internal requests: a feature
    (:meth:`vllm_kvreuse.core.feature.Feature.on_internal_output`)."""

    def on_internal_output(self, output: EngineCoreOutput) -> None: ...


class InternalRequests:
    """Spawned requests by id, and who spawned them."""

    def __init__(self, add: Callable[[Request], None]) -> None:
        self._add = add  # upstream's add_request, bypassing features' on_add
        self.owners: dict[str, Spawner] = {}
        self._retired: list[str] = []
        self.num_spawned = 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.owners

    def __bool__(self) -> bool:
        return bool(self.owners)

    def spawn(self, request: Request, owner: Spawner) -> None:
        """Adds ``request`` to the engine on behalf of ``owner``."""
        assert request.request_id not in self.owners, (
            f"internal request {request.request_id} spawned twice"
        )
        self.owners[request.request_id] = owner
        self.num_spawned += 1
        self._add(request)

    def retire(self, request_id: str) -> None:
        """``request_id`` was freed; forgotten once its last output is routed."""
        if request_id in self.owners:
            self._retired.append(request_id)

    def drop_retired(self) -> None:
        for request_id in self._retired:
            self.owners.pop(request_id, None)
        self._retired.clear()

    def route(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        """Takes internal requests' outputs out of ``outputs`` and hands each
        to the feature that spawned the request."""
        if not self.owners:
            return
        for engine_outputs in outputs.values():
            kept = []
            for out in engine_outputs.outputs:
                owner = self.owners.get(out.request_id)
                if owner is None:
                    kept.append(out)
                else:
                    owner.on_internal_output(out)
            engine_outputs.outputs = kept
        self.drop_retired()
