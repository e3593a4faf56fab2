"""Scheduler mixin: plans chunked requests and runs the fills of missing chunks.

A chunked request arrives with ``extra_args["kvreuse_chunks"]``, the token
lengths of its chunks (every segment but the question, which is the rest of
the prompt). On arrival the mixin:

1. keys each chunk (:mod:`vllm_kvreuse.chunk_cache.keys`), pins the chunks
   already stored or being filled, and reserves room for the others;
2. adds one *fill* per missing chunk, deduplicated across requests: an
   ordinary one-token request whose prompt is the chunk alone (after the
   system prompt in "system" mode), so its KV is chunk-isolated at virtual
   positions without any attention mask; its KV is saved to the store in the
   step that finishes its prefill, and its output never reaches a client;
3. re-hashes the request's blocks under a salt of its own
   (:func:`~vllm_kvreuse.chunk_cache.keys.chunked_salt`), so blocks holding
   chunk KV never match an ordinary request;
4. hands the plan to the connector, which makes vLLM load every chunk into
   the request's blocks (re-rotated) and prefill only the question.

If room cannot be reserved (a chunk larger than the store, or a store full
of pinned chunks), the request runs as an ordinary request instead: never
an error to the client.
"""

from __future__ import annotations

import itertools
from typing import Any

from vllm.logger import init_logger
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from vllm_kvreuse.admission.policy import REQUEST_FIELD as THRESHOLD_KEY
from vllm_kvreuse.chunk_cache.connector import (
    ChunkPlan,
    Fill,
    KVReuseChunkConnector,
    PlannedChunk,
)
from vllm_kvreuse.chunk_cache.keys import (
    chunk_key,
    chunked_salt,
    key_hasher,
    model_identity,
)
from vllm_kvreuse.chunk_cache.params import chunk_lengths
from vllm_kvreuse.config import KVReuseConfig

logger = init_logger(__name__)


class ChunkCacheMixin(Scheduler):
    """Turns chunked requests into chunk loads plus fills of missing chunks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = KVReuseConfig.from_vllm_config(self.vllm_config)
        self._chunks = (
            self.connector
            if isinstance(self.connector, KVReuseChunkConnector)
            else None
        )
        self._chunk_mode = settings.chunk_attention
        self._chunk_hasher = key_hasher(self.vllm_config, settings.chunk_cache_hash)
        self._chunk_identity = model_identity(self.vllm_config, self._chunk_mode)
        self._fill_ids: set[str] = set()
        self._fill_counter = itertools.count()
        self.num_degraded_chunked_requests = 0
        self._admin_pins: set[bytes] = set()
        # Tokens of each new chunked request not stored when it arrived: its
        # usage and prefill stats must not count them as cached, although
        # they are loaded like stored ones.
        self._uncached: dict[str, int] = {}

    # -- upstream hooks -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        lengths = chunk_lengths(request, request.num_prompt_tokens)
        if (
            self._chunks is None
            or lengths is None
            or request.request_id in self.requests
        ):
            super().add_request(request)
            return
        planned = self._plan(request, lengths)
        if planned is None:
            self.num_degraded_chunked_requests += 1
            logger.info(
                "chunk cache full or chunk too large: request %s runs as an "
                "ordinary request",
                request.request_id,
            )
            super().add_request(request)
            return
        plan, fills, uncached = planned
        for fill in fills:
            self._add_fill(fill)
        request.cache_salt = chunked_salt(request.cache_salt, self._chunk_mode, lengths)
        request.block_hashes = []
        request.update_block_hashes()
        self._chunks.add_plan(request.request_id, plan)
        if uncached:
            self._uncached[request.request_id] = uncached
        super().add_request(request)

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        output = super().schedule(*args, **kwargs)
        for request_id in list(self._uncached):
            request = self.requests.get(request_id)
            stats = request.prefill_stats if request is not None else None
            if request is None or stats is None:
                self._uncached.pop(request_id)
            elif stats.num_prompt_tokens:  # upstream set them at first schedule
                uncached = self._uncached.pop(request_id)
                stats.set(
                    num_prompt_tokens=stats.num_prompt_tokens,
                    num_local_cached_tokens=stats.num_local_cached_tokens,
                    num_external_cached_tokens=max(
                        0, stats.num_external_cached_tokens - uncached
                    ),
                )
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if not self._fill_ids:
            return outputs
        for engine_outputs in outputs.values():
            kept = []
            for out in engine_outputs.outputs:
                if out.request_id not in self._fill_ids:
                    kept.append(out)
                elif out.finish_reason is not None:
                    self._fill_ids.discard(out.request_id)
            engine_outputs.outputs = kept
        return outputs

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        """A preempted chunked request loads its chunks again when resumed:
        pin them again, and re-fill any evicted since its first load."""
        super()._preempt_request(request, *args, **kwargs)
        plan = self._chunks.plans.get(request.request_id) if self._chunks else None
        if plan is None or plan.pinned:
            return
        fills = self._hold_chunks(request, plan.chunks, plan.user_salt)
        if fills is None:
            # No room to compute them again: run on as an ordinary request
            # (it owns no blocks now, so its hashes can change).
            assert self._chunks is not None
            self._chunks.plans.pop(request.request_id, None)
            request.cache_salt = plan.user_salt
            request.block_hashes = []
            request.update_block_hashes()
            self.num_degraded_chunked_requests += 1
            return
        plan.pinned = True
        for fill in fills:
            self._add_fill(fill)

    def _add_fill(self, fill: Fill) -> None:
        assert self._chunks is not None
        self._chunks.add_fill(fill)
        self._fill_ids.add(fill.request.request_id)
        super().add_request(fill.request)

    def _free_request(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        if self._chunks is not None and request.request_id in self._chunks.fills:
            self._chunks.fill_finished(request.request_id)
        return super()._free_request(request, *args, **kwargs)

    def num_cache_hit_tokens(self, request: Request) -> int | None:
        """Local prefix hits plus the stored chunks past them (threshold check)."""
        plan = self._chunks.plans.get(request.request_id) if self._chunks else None
        if plan is None:
            return super().num_cache_hit_tokens(request)  # type: ignore[misc]
        _, num_local, *_ = self._get_local_prefix_cache_hit(request)
        stored = sum(
            chunk.length - max(0, min(chunk.length, num_local - chunk.start))
            for chunk in plan.chunks
            if (entry := self._chunks.index.get(chunk.key)) is not None and entry.ready
        )
        return min(num_local + stored, request.num_tokens)

    # -- planning --------------------------------------------------------------

    def _plan(
        self, request: Request, lengths: list[int]
    ) -> tuple[ChunkPlan, list[Fill], int] | None:
        """Keys, pins and reservations for ``request``: its plan, the fills it
        needs, and how many of its chunk tokens were not stored yet. None,
        holding nothing, if the store cannot take a missing chunk."""
        assert self._chunks is not None
        index = self._chunks.index
        prompt = request.prompt_token_ids or []
        system = prompt[: lengths[0]] if self._chunk_mode == "system" else []
        salt = self._key_salt(request.cache_salt, request.lora_request)
        chunks: list[PlannedChunk] = []
        start = 0
        for number, length in enumerate(lengths):
            context = system if number else []
            tokens = prompt[start : start + length]
            key = chunk_key(
                self._chunk_hasher, self._chunk_identity, salt, context, tokens
            )
            chunks.append(PlannedChunk(key, start, length, virtual_start=len(context)))
            start += length
        stored = [
            chunk.length
            for chunk in chunks
            if (entry := index.get(chunk.key)) is not None and entry.ready
        ]
        fills = self._hold_chunks(request, chunks, request.cache_salt)
        if fills is None:
            return None
        index.stats.hits += len(stored)
        index.stats.hit_tokens += sum(stored)
        index.stats.misses += len(fills)
        index.stats.miss_tokens += sum(fill.length for fill in fills)
        plan = ChunkPlan(chunks, user_salt=request.cache_salt)
        return plan, fills, plan.end - sum(stored)

    def _hold_chunks(
        self, request: Request, chunks: list[PlannedChunk], fill_salt: str | None
    ) -> list[Fill] | None:
        """Pins each chunk stored or being filled; reserves room for the others
        and returns their fills (not yet added). None, holding nothing, if the
        store cannot take one of them."""
        assert self._chunks is not None
        index = self._chunks.index
        prompt = request.prompt_token_ids or []
        pinned: list[bytes] = []
        fills: list[Fill] = []
        for chunk in chunks:
            if index.get(chunk.key) is not None:
                index.pin(chunk.key)
                pinned.append(chunk.key)
            elif index.reserve(chunk.key, chunk.length):
                context = prompt[: chunk.virtual_start]
                tokens = prompt[chunk.start : chunk.start + chunk.length]
                fills.append(
                    self._fill(
                        request,
                        chunk.key,
                        [*context, *tokens],
                        len(context),
                        fill_salt,
                    )
                )
            else:
                for key in pinned:
                    index.unpin(key)
                for fill in fills:
                    index.drop(fill.key)
                return None
        return fills

    @staticmethod
    def _key_salt(cache_salt: str | None, lora_request: Any) -> str:
        return "|".join((cache_salt or "", getattr(lora_request, "lora_name", "")))

    def chunk_cache_admin(
        self,
        action: str,
        token_ids: list[int] | None = None,
        system_token_ids: list[int] | None = None,
        cache_salt: str | None = None,
    ) -> dict[str, Any]:
        """The admin endpoint's actions: stats, clear, pin, unpin.

        ``pin`` holds a stored chunk (``token_ids``, after
        ``system_token_ids`` in "system" mode) against eviction until
        ``unpin``; an admin pin is counted once however often it is asked.
        """
        if self._chunks is None:
            raise ValueError("the chunk cache is not enabled on this server")
        index = self._chunks.index
        if action == "clear":
            return {"evicted": index.clear()}
        if action in ("pin", "unpin"):
            if not token_ids:
                raise ValueError("token_ids must list the chunk's token ids")
            context = system_token_ids or [] if self._chunk_mode == "system" else []
            key = chunk_key(
                self._chunk_hasher, self._chunk_identity,
                self._key_salt(cache_salt, None), context, token_ids,
            )  # fmt: skip
            entry = index.get(key)
            if entry is None or not entry.ready:
                return {"found": False}
            if action == "pin" and key not in self._admin_pins:
                self._admin_pins.add(key)
                index.pin(key)
            elif action == "unpin" and key in self._admin_pins:
                self._admin_pins.discard(key)
                index.unpin(key)
            return {"found": True, "pinned": entry.pins > 0}
        if action != "stats":
            raise ValueError(f"unknown chunk-cache action {action!r}")
        stats = self._chunks.snapshot()
        looked_up = stats["hits"] + stats["misses"]
        return {
            **stats,
            "hit_rate": stats["hits"] / looked_up if looked_up else 0.0,
            "device_capacity_bytes": index.capacity["device"],
            "cpu_capacity_bytes": index.capacity["cpu"],
            "degraded_requests": self.num_degraded_chunked_requests,
        }

    def _fill(
        self,
        request: Request,
        key: bytes,
        prompt: list[int],
        start: int,
        cache_salt: str | None,
    ) -> Fill:
        """A fill computing ``prompt[start:]`` after ``prompt[:start]``, hashed
        under the requester's own salt (its KV is ordinary KV of ``prompt``)."""
        fill = Request(
            request_id=f"kvreuse-fill-{next(self._fill_counter)}-{key.hex()[:12]}",
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(
                max_tokens=1, temperature=0.0, extra_args={THRESHOLD_KEY: 0.0}
            ),
            pooling_params=None,
            client_index=request.client_index,
            lora_request=request.lora_request,
            cache_salt=cache_salt,
            priority=request.priority,
            block_hasher=request._block_hasher,
        )
        return Fill(key=key, request=fill, start=start, length=len(prompt) - start)
