"""Upstream internal state the plugin reads or changes, per vLLM release.

Not patches: nothing here is replaced. The seam, :mod:`vllm_kvreuse.core.upstream`
(one module a side: scheduler, a request's state, frontend, worker),
reads and writes these attributes of upstream objects, where no public
method does what the features need (queues, seat limits, block tables, the
copy-on-write queue, a request's private token lists and hashes, the step
output's parallel lists). A few private attributes are touched by the
module of the registered patch that needs them instead (``seam``): the
serving renderers' model check, argparse's groups. Each entry names its
owner class, why, the one module that touches it (``seam``), and per
supported release the method's signature
(:func:`~vllm_kvreuse.patches.registry.signature_of`) or :data:`ATTRIBUTE`
(present on a real instance). ``tests/unit/test_upstream_state.py`` checks
every entry on real upstream objects, so a renamed or removed attribute
fails a test, not a request; ``tests/unit/test_private_access.py`` that no
module but an entry's seam touches it, and that the package touches no
private upstream attribute without an entry.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kvreuse.patches.registry import V0_32_0

ATTRIBUTE = "attribute"
"""A data attribute (or property): checked present on a real instance."""

SEAM = "vllm_kvreuse.core.upstream.scheduler"
"""The scheduler side of the seam: the module that touches upstream state
unless an entry names another."""
REQUEST_SEAM = "vllm_kvreuse.core.upstream.requests"
"""The seam's module for a request's own private state."""
FRONTEND_SEAM = "vllm_kvreuse.core.upstream.frontend"
"""The seam's module for the API server's and engine client's state."""
WORKER_SEAM = "vllm_kvreuse.core.upstream.worker"
"""The seam's module for the workers' state."""
EXTRA_ROWS_SEAM = "vllm_kvreuse.core.upstream.extra_rows"
"""The seam's module for rows a step runs outside upstream's loop."""


@dataclass(frozen=True, slots=True)
class UpstreamState:
    """One upstream attribute the plugin touches: ``target`` is
    ``"module:Owner.attr"`` (``"module:function"`` for a module's own
    function, whose owner is the module); ``releases`` maps a vLLM release to the
    method's signature, or :data:`ATTRIBUTE`; ``seam`` is the one module
    that touches it (:data:`SEAM`, or a registered patch's own module)."""

    target: str
    why: str
    releases: dict[str, str]
    seam: str = SEAM

    @property
    def owner(self) -> str:
        module, _, path = self.target.partition(":")
        return f"{module}:{path.rpartition('.')[0]}" if "." in path else module

    @property
    def name(self) -> str:
        return self.target.partition(":")[2].rpartition(".")[2]


_SCHED = "vllm.v1.core.sched.scheduler:Scheduler"
_KVM = "vllm.v1.core.kv_cache_manager:KVCacheManager"
_COORD = "vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator"
_SINGLE = "vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager"
_POOL = "vllm.v1.core.block_pool:BlockPool"
_REQ = "vllm.v1.request:Request"
_QUEUE = "vllm.v1.core.sched.request_queue:RequestQueue"
_OUT = "vllm.v1.core.sched.output"
_KV_BLOCK = "vllm.v1.core.kv_cache_utils.KVCacheBlock"
_ITER_REQS = "(self, requests: collections.abc.Iterable[vllm.v1.request.Request])"


def _attr(target: str, why: str, seam: str = SEAM) -> UpstreamState:
    return UpstreamState(target, why, {V0_32_0: ATTRIBUTE}, seam)


def _method(target: str, why: str, signature: str, seam: str = SEAM) -> UpstreamState:
    return UpstreamState(target, why, {V0_32_0: signature}, seam)


_QUEUES = (
    _attr(
        f"{_SCHED}.running",
        "held requests (live beam members sitting out) leave it for a "
        "schedule() and come back at its head (core/holds.py); stalled "
        "members are preempted out of it",
    ),
    _attr(
        f"{_SCHED}.waiting",
        "held requests (a beam step that does not fit, a chunked request "
        "waiting for its answer paths' scores) leave it for a schedule() and "
        "come back at its head (core/holds.py)",
    ),
    _attr(
        f"{_SCHED}.kv_holding_waiting",
        "the layer's memory-pressure check counts every waiting request",
    ),
    _attr(
        f"{_SCHED}.max_num_running_reqs",
        "a held running request keeps its seat: "
        "the limit shrinks while it sits out; a live width must fit it",
    ),
    _attr(
        f"{_SCHED}.max_num_active_reqs",
        "as max_num_running_reqs (the "
        "limit schedule() checks; lower under pipeline parallelism)",
    ),
    _method(
        f"{_SCHED}._preempt_request",
        "stalled live members are "
        "preempted as upstream preempts (also a hook-layer override)",
        "(self, request: vllm.v1.request.Request, timestamp: float, "
        "drop_stale_output: bool = False) -> None",
    ),
    _attr(
        f"{_SCHED}.requests",
        "a request whose workers' copy is stale is sent whole by id",
    ),
    _attr(f"{_SCHED}.kv_cache_manager", "the block tables and the pool"),
    _attr(
        f"{_SCHED}.use_v2_model_runner",
        "V2 workers need a resent request's whole token list in its NewRequestData",
    ),
    _attr(
        f"{_SCHED}.deferred_frees",
        "block accounting: references upstream keeps for a step in flight",
    ),
    _method(
        f"{_QUEUE}.remove_requests",
        "takes held requests out for a schedule()",
        f"{_ITER_REQS} -> None",
    ),
    _method(
        f"{_QUEUE}.prepend_requests",
        "puts held requests back at the head",
        f"{_ITER_REQS} -> None",
    ),
)

_KV = (
    _attr(f"{_KVM}.coordinator", "reaches the per-group managers' tables"),
    _attr(f"{_KVM}.block_pool", "references, frees, new copy blocks"),
    _attr(
        f"{_KVM}.kv_cache_config",
        "blocks are handed over only under full attention in every group",
    ),
    _attr(f"{_KVM}.enable_caching", "and only with prefix caching on"),
    _method(
        f"{_KVM}.get_blocks",
        "the ledger holds a finishing request's blocks",
        "(self, request_id: str) -> vllm.v1.core.kv_cache_manager.KVCacheBlocks",
    ),
    _method(
        f"{_KVM}.get_block_ids",
        "a resent request's NewRequestData; a live group's private blocks; "
        "the blocks a chunked request's chunks load into",
        "(self, request_id: str) -> tuple[list[int], ...]",
    ),
    _method(
        f"{_KVM}.prefix_cache_lookup_enabled",
        "a child inherits its parent's blocks only where upstream would look it up",
        "(self, request: vllm.v1.request.Request) -> bool",
    ),
    _attr(f"{_COORD}.single_type_managers", "one block table per group"),
    _attr(f"{_SINGLE}.req_to_blocks", "block accounting: every table's references"),
    _attr(
        f"{_SINGLE}._pending_cow_copies",
        "block accounting: upstream's queued copy-on-write endpoints",
    ),
    _method(
        f"{_POOL}.touch",
        "held and shared blocks take a reference",
        f"(self, blocks: collections.abc.Sequence[{_KV_BLOCK}]) -> None",
    ),
    _method(
        f"{_POOL}.free_blocks",
        "and drop it, tails first",
        f"(self, ordered_blocks: collections.abc.Iterable[{_KV_BLOCK}]) -> None",
    ),
    _method(f"{_POOL}.get_num_free_blocks", "a beam step must fit", "(self) -> int"),
    _attr(f"{_POOL}.num_gpu_blocks", "the retention budget is a fraction of the pool"),
    _attr(f"{_POOL}.blocks", "block accounting: every block's reference count"),
)

_REQUESTS = (
    _attr(
        f"{_REQ}._all_token_ids",
        "a live member takes another beam's "
        "history; a rewound member drops its last token",
        seam=REQUEST_SEAM,
    ),
    _attr(f"{_REQ}._output_token_ids", "(as _all_token_ids)", seam=REQUEST_SEAM),
    _attr(
        f"{_REQ}._block_hasher",
        "a beam member reuses the root's hasher; a path's scoring request "
        "hashes its prefix with its request's",
        seam=REQUEST_SEAM,
    ),
    _attr(
        f"{_REQ}.cache_salt",
        "a chunked request holding moved chunk KV is rehashed under a salt "
        "naming its values",
        seam=REQUEST_SEAM,
    ),
    _attr(
        f"{_REQ}.prompt_token_ids",
        "a resent request's history is its prompt, as a streaming update leaves it",
        seam=REQUEST_SEAM,
    ),
    _attr(f"{_REQ}.num_prompt_tokens", "(as prompt_token_ids)", seam=REQUEST_SEAM),
    _attr(
        f"{_REQ}.num_computed_tokens",
        "a rewound member computes its last position again; a segmented "
        "chunked request skips the region the connector loads",
        seam=REQUEST_SEAM,
    ),
    _attr(
        f"{_REQ}.spec_token_ids",
        "a resent request drops speculated tokens",
        seam=REQUEST_SEAM,
    ),
    _attr(
        f"{_REQ}.block_hashes",
        "a beam member takes the root's prompt hashes, a resent request its "
        "own cut, a chunked request new ones",
        seam=REQUEST_SEAM,
    ),
    _method(
        f"{_REQ}.update_block_hashes",
        "hashes the blocks past the taken ones",
        "(self) -> None",
        seam=REQUEST_SEAM,
    ),
    _attr(
        "vllm.sampling_params:SamplingParams._eos_token_id",
        "a live member never stops on its own: the derived EOS goes too",
        seam=REQUEST_SEAM,
    ),
    _attr(
        "vllm.sampling_params:SamplingParams._all_stop_token_ids",
        "(as _eos_token_id)",
        seam=REQUEST_SEAM,
    ),
    _attr(
        "vllm.config.parallel:ParallelConfig._api_process_count",
        "continuation children may reach another API server",
        seam=FRONTEND_SEAM,
    ),
)

_OUTPUT = (
    _method(
        f"{_OUT}:CachedRequestData.__init__",
        "a resent request "
        "leaves the cached rows: each parallel list is rewritten by "
        "name, so a new field must be added there",
        "(self, req_ids: list[str], resumed_req_ids: set[str], "
        "new_token_ids: list[list[int]], all_token_ids: dict[str, "
        "list[int]], new_block_ids: list[tuple[list[int], ...] | None], "
        "num_computed_tokens: list[int], num_output_tokens: list[int]) "
        "-> None",
    ),
    _method(
        f"{_OUT}:NewRequestData.from_request",
        "and is sent whole as a streaming update",
        "(request: object, block_ids: "
        "tuple[list[int], ...], prefill_token_ids: list[int] | None = "
        "None, uses_mrope: bool = False) -> 'NewRequestData'",
    ),
    _attr(
        f"{_OUT}:NewRequestData.num_computed_tokens",
        "schedule() has already advanced the request past the step",
    ),
)

_ROWS_WHY = "rows a step adds outside upstream's loop (beam groups stepped as one): "
_EXTRA_ROWS = (
    _attr(f"{_SCHED}.max_num_scheduled_tokens", _ROWS_WHY + "their tokens, borrowed",
          EXTRA_ROWS_SEAM),
    _attr(f"{_SCHED}.prev_step_scheduled_req_ids", _ROWS_WHY + "scheduled (V1)",
          EXTRA_ROWS_SEAM),
    _attr(f"{_SCHED}.defer_block_free", _ROWS_WHY + "fenced", EXTRA_ROWS_SEAM),
    _attr(f"{_SCHED}.sched_step_seq", _ROWS_WHY + "the fence", EXTRA_ROWS_SEAM),
    _attr(f"{_OUT}:CachedRequestData.num_computed_tokens",
          _ROWS_WHY + "their positions", EXTRA_ROWS_SEAM),
    _method(f"{_OUT}:NewRequestData.from_request",
            _ROWS_WHY + "admitted outside schedule(), sent whole",
            "(request: object, block_ids: tuple[list[int], ...], "
            "prefill_token_ids: list[int] | None = None, uses_mrope: bool = "
            "False) -> 'NewRequestData'", EXTRA_ROWS_SEAM),
    _attr(f"{_REQ}.num_in_flight_tokens", _ROWS_WHY + "in flight", REQUEST_SEAM),
    _attr(f"{_REQ}.last_sched_seq", _ROWS_WHY + "fenced", REQUEST_SEAM),
)  # fmt: skip

_SERVING = "vllm.entrypoints.serve.engine.serving:BaseServing"
_CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"

_FRONTEND = (
    _method(
        f"{_SERVING}._check_model",
        "a request a feature renders (a continuation, a chunked prompt) passes "
        "vLLM's model check (LoRA names, the request log) as the unpatched "
        "renderer's does first; public OpenAIServingModels.check_model knows "
        "no LoRA adapter",
        "sha256:80a4095385b7c999",
        seam="vllm_kvreuse.frontend",
    ),
    _method(
        f"{_SERVING}._maybe_get_adapters",
        "a continuation must use its parent's LoRA adapter: the one vLLM will "
        "run it with, or vLLM's own not-found error",
        "sha256:4ac69e8098989020",
        seam=FRONTEND_SEAM,
    ),
    _method(
        f"{_CPU_ATTN}:_get_attn_isa",
        "the chunk cache reads and writes vLLM's CPU attention cache in the "
        "packing that attention chose for it (AMX, VEC, VEC16, ...); vLLM "
        "keeps the choice nowhere public before the first forward pass",
        "(dtype: torch.dtype, block_size: int, head_size: int | None = None, "
        "kv_cache_dtype: str | None = None) -> str",
        seam=WORKER_SEAM,
    ),
    _attr(
        "argparse:ArgumentParser._action_groups",
        "the plugin's flag group is added once per parser (EngineArgs and "
        "AsyncEngineArgs both add theirs); argparse lists groups nowhere else",
        seam="vllm_kvreuse.engine_args",
    ),
)

UPSTREAM_STATE: tuple[UpstreamState, ...] = (
    *_QUEUES,
    *_KV,
    *_REQUESTS,
    *_OUTPUT,
    *_EXTRA_ROWS,
    *_FRONTEND,
)
"""Every private (or seam-owned) upstream attribute the plugin touches."""
