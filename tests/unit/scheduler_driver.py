"""A real scheduler with every feature on, chunk cache included, driven step by
step without an engine; and the invariants the randomised test checks.

:func:`make_full_scheduler` builds the scheduler class vLLM would pick with
the plugin's chunk-cache connector in vLLM's KV-connector slot (scheduler
role only: no worker exists, so a chunk is "stored" when the step that
completes its fill is built, as the scheduler side decides). The
:class:`Driver` adds requests, aborts them as a client would, preempts them
as upstream does, and runs steps with fake model outputs; it records what
reaches the client and checks the invariants after every action.
"""

from __future__ import annotations

import time
import zlib
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.outputs import (
    KVConnectorOutput,
    LogprobsLists,
    LogprobsTensors,
    ModelRunnerOutput,
)
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from tests.conftest import BLOCK_SIZE
from vllm_kvreuse.beam import result as beam_result
from vllm_kvreuse.chunk_cache.engine.planner import ChunkScheduler
from vllm_kvreuse.chunk_cache.engine_args import CHUNK_CONNECTOR, CHUNK_CONNECTOR_MODULE
from vllm_kvreuse.chunk_cache.messages import ChunkWorkerReport
from vllm_kvreuse.config import ADDITIONAL_CONFIG_KEY
from vllm_kvreuse.core.accounting import check_block_accounting
from vllm_kvreuse.testing.fake_worker import model_output as made_up_output

MAX_MODEL_LEN = 256
SAMPLED = 7  # the token every request samples
EOS = 2  # beam groups' eos_token_id
LOGPROBS = [-0.1, -0.1, -0.2, -0.3, -0.4, -0.5, -0.6]  # of each row's tokens
MAX_IDLE_STEPS = 16
"""Steps in a row that may schedule nothing while requests wait or run: each
such step releases one held entry per feature (memory pressure), so only a
pool full of held entries can take more than a few."""


def make_full_scheduler(
    model_config: ModelConfig,
    num_blocks: int = 24,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 64,
    async_scheduling: bool = False,
    **kvreuse: Any,
) -> Scheduler:
    """A real scheduler with all four features and the chunk-cache connector;
    ``kvreuse`` overrides plugin settings (a store of 0.25 of the pool).

    The KV-cache config names one tensor per layer group so the chunk
    store's capacity (a fraction of the KV cache's bytes) is not zero.
    """
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig.default_factory(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=MAX_MODEL_LEN,
            async_scheduling=async_scheduling,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector=CHUNK_CONNECTOR,
            kv_connector_module_path=CHUNK_CONNECTOR_MODULE,
            kv_role="kv_both",
        ),
        additional_config={
            ADDITIONAL_CONFIG_KEY: dict(
                enable_chunk_cache=True,
                enable_continuation=True,
                engine_beam_search=True,
                global_cache_hit_threshold=0.0,
                chunk_cache_device_fraction=0.25,
            )
            | kvreuse
        },
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    # vLLM's CPU platform turns async scheduling off; GPUs have it on by
    # default, and the scheduler is the same Python on both.
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    spec = FullAttentionSpec(
        BLOCK_SIZE, num_kv_heads=1, head_size=32, dtype=model_config.dtype
    )
    page = spec.page_size_bytes
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * num_blocks,
                layers=["layer"],
                layer_stride=page * num_blocks,
                block_stride=page,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
    return scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )


ROW = "#kvreuse-row-"  # in a row request's id (Upstream.split_rows)


def _assert_rows_end(rows: set[str], output: SchedulerOutput) -> None:
    """A step's row requests are ended by the next schedule's output, and
    each row shares its request's blocks (one block table, several rows)."""
    missing = rows - output.finished_req_ids
    assert not missing, f"row requests never ended: {missing}"
    new = {n.req_id: n for n in output.scheduled_new_reqs}
    for row_id in (r for r in new if ROW in r):
        parent = new[row_id.partition(ROW)[0]]
        assert new[row_id].block_ids == parent.block_ids
        assert new[row_id].num_computed_tokens < parent.num_computed_tokens


def completing(scheduler: Scheduler, output: SchedulerOutput) -> set[str]:
    """Requests whose step ``output`` computes every token they have: they
    sample one. Read right after ``schedule``, as the model runner knows it
    (with async scheduling, the previous step's token is not appended yet)."""
    return {
        req_id
        for req_id in output.num_scheduled_tokens
        if (request := scheduler.requests.get(req_id)) is not None
        and request.num_computed_tokens >= request.num_tokens
    }


def fake_model_output(
    scheduler: Scheduler,
    output: SchedulerOutput,
    sampling: set[str],
    variant: int = 0,
    eos: bool = False,
) -> ModelRunnerOutput:
    """What a model run would return: a token for each request in
    ``sampling``, none for a partial prefill; the step's beam groups run
    through the real worker code on made-up logits (a log-prob row for each
    request, for fork members); made-up prompt log-probs for each request in
    ``sampling`` that asks for them (answer paths' scoring requests).
    ``variant`` and ``eos`` change the logits and rows, so beams diverge or
    end and another path wins.
    """

    def rows(req_ids: list[str]) -> LogprobsLists:
        n = len(req_ids)
        # The sampled token first, as vLLM's sampler lists it.
        row = [SAMPLED, SAMPLED, 8 + variant, EOS if eos else 9 + variant, 20, 21, 22]
        return LogprobsLists(
            logprob_token_ids=np.array([row] * n, dtype=np.int64).reshape(n, 7),
            logprobs=np.array([LOGPROBS] * n).reshape(n, 7),
            sampled_token_ranks=np.ones(n, dtype=np.int64),
        )

    out = made_up_output(
        scheduler, output, sampling, SAMPLED, variant, EOS if eos else None, rows
    )
    for req_id in sampling:
        request = scheduler.requests.get(req_id)
        if request is not None and request.sampling_params.prompt_logprobs is not None:
            out.prompt_logprobs_dict[req_id] = _prompt_logprobs(request, variant)
    return out


def _prompt_logprobs(request: Request, variant: int) -> LogprobsTensors:
    """Every prompt row's log-prob of the next prompt token (column 0, as
    vLLM's V1 runner returns them at the end of a prefill), made up from the
    request id and ``variant``."""
    tokens = request.prompt_token_ids or []
    seed = zlib.crc32(f"{request.request_id}/{variant}".encode())
    values = [-((seed >> (i % 24)) % 7) / 10 for i in range(len(tokens) - 1)]
    return LogprobsTensors(
        logprob_token_ids=torch.tensor(tokens[1:]).reshape(-1, 1),
        logprobs=torch.tensor(values).reshape(-1, 1),
        selected_token_ranks=torch.zeros(len(tokens) - 1, dtype=torch.int64),
    )


@dataclass(slots=True)
class Client:
    """What one client request has received."""

    request: Request
    kind: str
    finals: list[EngineCoreOutput] = field(default_factory=list)
    aborted: bool = False
    # Aborted after the engine had finished it (a rejection or failure at an
    # arrival), its final output not yet delivered: that output still comes
    # with the next step (the frontend drops it).
    answer_in_flight: bool = False

    @property
    def open(self) -> bool:
        return not self.aborted and not self.finals


class Driver:
    """Drives one scheduler like an engine core and a client would."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        # As the engine core: one batch at a time, two with async scheduling.
        self.batch_queue_size = scheduler.vllm_config.max_concurrent_batches
        self._in_flight: deque[tuple[SchedulerOutput, set[str]]] = deque()
        self.side: ChunkScheduler = scheduler.connector.scheduler_side
        self.pool_size = scheduler.kv_cache_manager.block_pool.num_gpu_blocks
        self.clients: dict[str, Client] = {}
        self.num_steps = 0
        self.scheduled: list[str] = []  # the last schedule's requests
        self.idle_steps = 0
        self.max_idle_steps = 0
        self.log: list[str] = []  # the actions, for failure messages
        self.seen: Counter[str] = Counter()  # what happened, for statistics
        self._rows: set[str] = set()  # row requests of the last schedule
        self.last_scheduled: dict[str, int] = {}  # the last schedule's tokens
        # The workers' chunk bytes: key -> (stored start, origin), as the
        # step's store decisions and saves leave them; ``broken``: chunks
        # whose bytes a tier lost (reported with the next step).
        self.chunk_bytes: dict[bytes, tuple[int, bytes]] = {}
        self.broken: set[bytes] = set()
        self.healing: set[bytes] = set()  # lost, not stored again yet
        self.reported_lost: set[bytes] = set()  # lost, reported, not stored again

    # -- a client's and an engine core's actions ---------------------------------

    def add(self, request: Request, kind: str) -> None:
        self.clients[request.request_id] = Client(request, kind)
        self.scheduler.add_request(request)
        self.log.append(f"add {kind} {request.request_id}")

    def abort(self, request_id: str) -> None:
        """A client abort, as ``EngineCore.abort_requests`` does it."""
        client = self.clients[request_id]
        client.aborted = True
        client.answer_in_flight = any(
            out.request_id == request_id for _, out in self.scheduler.kvreuse._emitted
        )
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        self.log.append(f"abort {request_id}")

    def preempt(self, request_id: str) -> None:
        """Preempts a running request with upstream's own method."""
        request = self.scheduler.requests[request_id]
        self.scheduler.running.remove(request)
        self.scheduler._preempt_request(request, time.monotonic())
        self.log.append(f"preempt {request_id}")

    def open_clients(self) -> list[str]:
        return [rid for rid, client in self.clients.items() if client.open]

    def running(self) -> list[str]:
        return [r.request_id for r in self.scheduler.running]

    def step(
        self, variant: int = 0, eos: bool = False, abort_during: int | None = None
    ) -> None:
        """One engine-core step, as ``EngineCore.step`` (or, with async
        scheduling, ``step_with_batch_queue``: schedule the next batch while
        one runs, then wait for the oldest); ``abort_during`` picks an open
        client to abort while the batch runs (aborts that arrive then are
        processed just before ``update_from_output``)."""
        scheduler = self.scheduler
        if scheduler.has_requests():
            runnable = bool(
                scheduler.waiting or scheduler.running or scheduler.kv_holding_waiting
            )
            output = scheduler.schedule()
            self._in_flight.appendleft((output, completing(scheduler, output)))
            self._scheduled(output, runnable)
            if len(self._in_flight) < self.batch_queue_size and (
                output.total_num_scheduled_tokens > 0 or scheduler.has_requests()
            ):
                return
        elif not self._in_flight:
            return
        output, sampling = self._in_flight.pop()
        open_clients = self.open_clients()
        if abort_during is not None and open_clients:
            self.abort(open_clients[abort_during % len(open_clients)])
            self.seen["aborts while a batch runs"] += 1
        model_output = fake_model_output(scheduler, output, sampling, variant, eos)
        model_output.kv_connector_output = self._run_chunk_work(output)
        engine_outputs = scheduler.update_from_output(output, model_output)
        for outputs in engine_outputs.values():
            for out in outputs.outputs:
                self._receive(out)

    def lose_chunk(self, key: bytes) -> None:
        """A tier loses ``key``'s bytes (a damaged file, a store eviction):
        reported with the next step that runs, as a worker reports it."""
        self.chunk_bytes.pop(key, None)
        self.broken.add(key)
        self.healing.add(key)
        self.log.append(f"lose chunk {key.hex()[:8]}")

    def _run_chunk_work(self, output: SchedulerOutput) -> KVConnectorOutput:
        """The workers' side of a step's chunk metadata, as
        :class:`~vllm_kvreuse.chunk_cache.worker.chunks.ChunkWorker` runs it:
        a load of bytes other than the plan names (lost, or another chunk
        stored under the key since) fails its blocks; a wrong load would
        show as a load of bytes that do not match, which is never made."""
        meta = output.kv_connector_metadata
        for op in meta.ops:
            if op.kind == "evict":
                self.chunk_bytes.pop(op.key, None)
        invalid: set[int] = set()
        for load in meta.loads:
            for piece in load.pieces:
                stored = self.chunk_bytes.get(piece.key)
                if stored != (piece.stored_start, piece.origin):
                    first = piece.dst_start // BLOCK_SIZE
                    last = (piece.dst_start + piece.count - 1) // BLOCK_SIZE
                    invalid.update(load.block_ids[first : last + 1])
                    self.seen["chunk loads failed"] += 1
        for save in meta.saves:
            self.chunk_bytes[save.key] = (save.start, save.origin)
            self.seen["chunks stored again after a loss"] += save.key in self.healing
            self.healing.discard(save.key)
        lost, self.broken = self.broken, set()
        self.reported_lost |= lost
        return KVConnectorOutput(
            invalid_block_ids=invalid,
            kv_connector_worker_meta=ChunkWorkerReport(lost) if lost else None,
        )

    def has_work(self) -> bool:
        return self.scheduler.has_requests() or bool(self._in_flight)

    def drain(self, max_steps: int) -> None:
        """Steps, with no new arrivals, until no request is left."""
        for _ in range(max_steps):
            if not self.has_work():
                return
            self.step()
        raise AssertionError(
            f"requests left after {max_steps} steps with no arrivals: "
            f"{_queues(self.scheduler)}"
        )

    def _scheduled(self, output: SchedulerOutput, runnable: bool) -> None:
        """Records a schedule and checks liveness."""
        self.num_steps += 1
        self.scheduled = list(output.num_scheduled_tokens)
        self.last_scheduled = dict(output.num_scheduled_tokens)
        _assert_rows_end(self._rows, output)
        self._rows = {r for r in self.scheduled if ROW in r}
        self.seen["one-step prefills"] += len({r.partition(ROW)[0] for r in self._rows})
        meta = output.kv_connector_metadata
        self.seen["chunk loads"] += len(meta.loads)
        self.seen["chunk saves"] += len(meta.saves)
        self.reported_lost -= {save.key for save in meta.saves}
        self.seen["chunk demotions"] += sum(
            (op.kind, op.target) == ("move", "cpu") for op in meta.ops
        )
        self.seen["upstream preemptions"] += len(output.preempted_req_ids)
        self.seen["copy-on-write forks"] += len(output.kv_cache_block_copies or ())
        self.seen["two batches in flight"] += len(self._in_flight) > 1
        self.seen["deferred block frees"] += bool(self.scheduler.deferred_frees)
        if output.num_scheduled_tokens or not runnable:
            self.idle_steps = 0
        else:
            self.idle_steps += 1
            self.max_idle_steps = max(self.max_idle_steps, self.idle_steps)
        self.log.append(f"step {dict(output.num_scheduled_tokens)}")
        _assert_progress(self)

    def _receive(self, out: EngineCoreOutput) -> None:
        client = self.clients.get(out.request_id)
        assert client is not None, (
            f"output of {out.request_id!r} reached the client, which never sent "
            "it (an internal request leaked out of the hook layer)"
        )
        assert not client.finals, f"{out.request_id}: an output after its final one"
        assert not client.aborted or client.answer_in_flight, (
            f"{out.request_id}: an output after its abort"
        )
        if out.finish_reason is None:
            return
        client.finals.append(out)
        # A beam group's result rides in its root's stop reason.
        reason = "beams" if beam_result.decode(out.stop_reason) else out.stop_reason
        self.seen[f"{client.kind} {out.finish_reason.name} {reason}"] += 1

    # -- invariants --------------------------------------------------------------

    def check(self) -> None:
        """Invariants that hold between any two actions."""
        check_block_accounting(self.scheduler)
        _assert_chunk_index_consistent(self.side)
        _assert_waiting_chunks_pinned(self)
        _assert_lost_chunks_not_offered(self)
        _assert_holds_live(self.scheduler)

    def check_drained(self) -> None:
        """After a drain and a cache reset: nothing held, nothing owed."""
        scheduler = self.scheduler
        owed = [
            rid
            for rid, client in self.clients.items()
            if client.open or (client.answer_in_flight and not client.finals)
        ]
        assert not owed, f"client requests never answered: {owed}"
        assert not scheduler.requests, f"requests left: {list(scheduler.requests)}"
        ledger = scheduler.kvreuse.ledger
        assert not len(ledger), (
            f"held after reset: {[e.request_id for e in ledger.entries()]}"
        )
        free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        assert free == self.pool_size - 1, (
            f"{self.pool_size - 1 - free} KV blocks still referenced after drain"
        )
        index = self.side.store.index
        pinned = {k.hex()[:8]: e.pins for k, e in index.entries.items() if e.pins}
        assert not pinned, f"chunks still pinned after drain: {pinned}"
        reserved = [k.hex()[:8] for k, e in index.entries.items() if not e.ready]
        assert not reserved, f"chunks still reserved after drain: {reserved}"
        assert not self.side.plans, f"chunk plans {list(self.side.plans)} left"
        internal = list(scheduler.kvreuse.internal.owners)
        assert not internal, f"internal requests never retired: {internal}"
        assert not len(scheduler.kvreuse.holds), "requests held after drain"
        beam = scheduler.feature("beam")
        assert beam.groups.is_empty(), "beam groups left"


def _queues(scheduler: Scheduler) -> dict[str, Any]:
    return {
        "waiting": [r.request_id for r in scheduler.waiting],
        "running": [r.request_id for r in scheduler.running],
        "kv_holding_waiting": [r.request_id for r in scheduler.kv_holding_waiting],
        "free_blocks": scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
        "held": [e.request_id for e in scheduler.kvreuse.ledger.entries()],
    }


def _assert_progress(driver: Driver) -> None:
    assert driver.idle_steps <= MAX_IDLE_STEPS, (
        f"no token scheduled for {driver.idle_steps} steps while requests could "
        f"run: {_queues(driver.scheduler)}; last actions: {driver.log[-8:]}"
    )


def _assert_holds_live(scheduler: Scheduler) -> None:
    """Between steps, every held request is live (never a finished one) and
    in vLLM's queues, and no request is queued twice or queued finished."""
    holds = scheduler.kvreuse.holds
    assert holds.taken == ([], []), "held requests still out of their queues"
    for request in holds.held():
        assert not request.is_finished(), f"{request.request_id} held finished"
        assert scheduler.requests.get(request.request_id) is request, (
            f"{request.request_id} held, unknown to the scheduler"
        )
    queued = [*scheduler.waiting, *scheduler.running, *scheduler.kv_holding_waiting]
    ids = [r.request_id for r in queued]
    assert len(ids) == len(set(ids)), f"a request queued twice: {_queues(scheduler)}"
    finished = [r.request_id for r in queued if r.is_finished()]
    assert not finished, f"finished requests queued: {finished}"


def _assert_chunk_index_consistent(side: ChunkScheduler) -> None:
    index = side.store.index
    for tier in ("device", "cpu"):
        used = sum(e.nbytes for e in index.entries.values() if e.tier == tier)
        assert index.used[tier] == used, (
            f"{tier} tier: used {index.used[tier]} != {used}"
        )
        assert used <= index.capacity[tier], f"{tier} tier over capacity"
    num_pinned = sum(1 for e in index.entries.values() if e.pins)
    assert index.num_pinned == num_pinned, (
        f"num_pinned {index.num_pinned}, but {num_pinned} entries have pins"
    )


def _assert_lost_chunks_not_offered(driver: Driver) -> None:
    """A chunk whose loss the workers reported is not stored, so no later
    request plans to load it, until a request stores it again."""
    index = driver.side.store.index
    for key in driver.reported_lost:
        entry = index.get(key)
        assert entry is None or not entry.ready, (
            f"chunk {key.hex()[:8]} was lost, yet the store offers it "
            f"({entry.pins} pins)"
        )


def _assert_waiting_chunks_pinned(driver: Driver) -> None:
    """Every chunk a pinned plan will load is in the store and pinned, so no
    eviction can take it before its load; every chunk a plan will store is
    reserved by that request."""
    side = driver.side
    index = side.store.index
    for request_id, plan in side.plans.items():
        held = {key: entry for key, entry in plan.held}
        for chunk in plan.chunks:
            entry = index.get(chunk.key)
            if plan.pinned and chunk.loads and entry is held.get(chunk.key):
                assert entry is not None and entry.ready and entry.pins > 0, (
                    f"{request_id} will load chunk {chunk.key.hex()[:8]}, which is "
                    f"{'unpinned' if entry else 'not stored'}"
                )
        for chunk in plan.unsaved:
            entry = index.get(chunk.key)
            assert entry is not None and entry.owner == request_id, (
                f"{request_id} will store chunk {chunk.key.hex()[:8]}, not reserved"
            )
