"""Patches on the engine clients, the engine core and the workers."""

from __future__ import annotations

from vllm_kvreuse.patches.registry import ABSENT, V0_32_0, Patch

PATCHES: tuple[Patch, ...] = (
    Patch(
        target="vllm.v1.engine.input_processor:InputProcessor._validate_params",
        wrapper="vllm_kvreuse.frontend:wrap_validate_params",
        kind="function",
        signatures={
            V0_32_0: "(self, params: vllm.sampling_params.SamplingParams | "
            "vllm.pooling_params.PoolingParams, supported_tasks: "
            "tuple[typing.Literal['generate', 'transcription', 'realtime', "
            "'embed', 'classify', 'token_embed', 'token_classify', 'plugin', "
            "'embed&token_classify', 'render'], ...]) -> bool | None"
        },
        why="A bad plugin option in SamplingParams.extra_args must fail in the "
        "caller's process with a clear error, not in the engine.",
        how="Calls the original, then validates the plugin's extra_args keys.",
        remove_when="vLLM validates plugin extra_args (no hook today).",
    ),
    Patch(
        target="vllm.v1.engine.async_llm:AsyncLLM.__init__",
        wrapper="vllm_kvreuse.continuation.frontend:wrap_engine_client_init",
        kind="function",
        signatures={V0_32_0: "sha256:79a4280ae07a9fb6"},
        why="Continuation needs one parent registry per engine client, able "
        "to wake the engine core when a retention expires.",
        how="Calls the original; with continuation on, gives the output "
        "processor its registry, bound to the engine-core client.",
        remove_when="vLLM keeps finished requests' tokens addressable by id.",
    ),
    Patch(
        target="vllm.v1.engine.llm_engine:LLMEngine.__init__",
        wrapper="vllm_kvreuse.continuation.frontend:wrap_engine_client_init",
        kind="function",
        signatures={V0_32_0: "sha256:fe9afe55aa7cc7fc"},
        why="As AsyncLLM.__init__, for the offline engine (LLM).",
        how="As AsyncLLM.__init__ (no wake-up: expired parents are released at "
        "the next step).",
        remove_when="As AsyncLLM.__init__.",
    ),
    Patch(
        target="vllm.v1.engine.output_processor:OutputProcessor.add_request",
        wrapper="vllm_kvreuse.continuation.frontend:wrap_add_request",
        kind="function",
        signatures={
            V0_32_0: "(self, request: vllm.v1.engine.EngineCoreRequest, "
            "prompt: str | None, parent_req: "
            "vllm.v1.engine.parallel_sampling.ParentRequest | None = None, "
            "request_index: int = 0, queue: "
            "vllm.v1.engine.output_processor.RequestOutputCollector | None = None) "
            "-> None"
        },
        why="A continuation names its parent by id, so the frontend must know "
        "each request's engine id, prompt tokens, cache_salt and LoRA.",
        how="Calls the original, then records the new request in the output "
        "processor's parent registry.",
        remove_when="vLLM keeps finished requests' tokens addressable by id.",
    ),
    Patch(
        target="vllm.v1.engine.core:EngineCore.kvreuse_release_expired",
        wrapper="vllm_kvreuse.continuation.engine:make_release_expired_utility",
        kind="new",
        signatures={V0_32_0: ABSENT},
        why="An idle engine core blocks on its input queue, so retained KV "
        "would outlive its TTL until the next request.",
        how="Adds an engine-core utility; the frontend calls it (through "
        "call_utility_async) when a retained parent's TTL runs out.",
        remove_when="vLLM schedules timed work in the engine core.",
    ),
    Patch(
        target="vllm.v1.engine.core:EngineCore.kvreuse_find_parent",
        wrapper="vllm_kvreuse.continuation.engine:make_find_parent_utility",
        kind="new",
        signatures={V0_32_0: ABSENT},
        why="With several API-server processes a child may reach one that did "
        "not serve its parent; only the engine core that ran the parent knows "
        "its tokens (and holds its blocks).",
        how="Adds an engine-core utility answering a look-up by client request "
        "id and cache_salt from the engine's records of finished requests; "
        "API servers call it on every engine (call_utility_all_async).",
        remove_when="vLLM keeps finished requests' tokens addressable by id "
        "across API servers.",
    ),
    Patch(
        target="vllm.v1.engine.core_client:"
        "DPLBAsyncMPClient.get_core_engine_for_request",
        wrapper="vllm_kvreuse.continuation.remote:wrap_get_core_engine_for_request",
        kind="function",
        signatures={
            V0_32_0: "(self, request: vllm.v1.engine.EngineCoreRequest) -> bytes"
        },
        why="With data parallelism the load balancer picks an engine per "
        "request by queue length, so a child would be sent blind to any rank, "
        "while its parent's retained blocks are on one.",
        how="A request that names a parent (kvreuse_parent) gets the parent's "
        "rank as its data_parallel_rank (vLLM's own routing field) before the "
        "original picks; the rank each request went to is recorded.",
        remove_when="vLLM routes a request by a KV-affinity hint.",
    ),
    Patch(
        target="vllm.v1.engine.core:EngineCore.kvreuse_chunk_cache",
        wrapper="vllm_kvreuse.chunk_cache.engine.admin:make_chunk_cache_utility",
        kind="new",
        signatures={V0_32_0: ABSENT},
        why="The chunk store's index lives in the scheduler, in the engine "
        "core; the admin endpoint (an endpoint plugin) needs a way to reach it.",
        how="Adds an engine-core utility that the endpoint plugin calls through "
        "call_utility_async: stats, clear, pin, unpin.",
        remove_when="vLLM exposes KV-connector admin calls.",
    ),
    Patch(
        target="vllm.v1.engine.output_processor:RequestState._new_completion_output",
        wrapper="vllm_kvreuse.frontend:wrap_new_completion_output",
        kind="function",
        signatures={
            V0_32_0: "(self, token_ids: list[int], finish_reason: "
            "vllm.v1.engine.FinishReason | None, stop_reason: int | str | None) "
            "-> vllm.outputs.CompletionOutput"
        },
        why="FinishReason is a closed IntEnum, so the engine cannot send "
        "'cache_threshold' as a finish reason.",
        how="The scheduler finishes a rejected request as ABORT with "
        "stop_reason 'cache_threshold'; this wrapper turns that pair into "
        "finish_reason 'cache_threshold' and counts it in /metrics. It also "
        "records a finished request's delivered tokens for continuations.",
        remove_when="FinishReason gains a cache-threshold member.",
    ),
    Patch(
        target="vllm.utils.ompmultiprocessing:OMPProcessManager.__init__",
        wrapper="vllm_kvreuse.device.cpu_cores:wrap_omp_manager_init",
        kind="function",
        signatures={V0_32_0: "(self, config: 'VllmConfig')"},
        why="On CPU, vLLM keeps one more core per worker free of OpenMP "
        "threads whenever any KV connector is set (for NIXL's transfer "
        "threads); the chunk-cache connector has none. With 2 cores per "
        "worker the reservation cannot be met, vLLM then reserves no core, "
        "and the worker's threads share every core with the busy-polling "
        "engine core: every step ~4x slower with the cache on, used or not.",
        how="When the connector is one of the plugin's (the chunk cache's), "
        "alone, calls the "
        "original with a read-only view of the config whose "
        "kv_transfer_config is None, so cores are bound as plain vLLM binds "
        "them; any other connector, and VLLM_CPU_NUM_OF_RESERVED_CPU, as "
        "upstream.",
        remove_when="vLLM reserves the extra core only for connectors that "
        "ask for it (a connector capability, or NIXL only).",
    ),
    Patch(
        target="vllm.v1.worker.worker_base:WorkerBase.__init__",
        wrapper="vllm_kvreuse.runners:wrap_worker_init",
        kind="function",
        signatures={
            V0_32_0: "(self, vllm_config: vllm.config.vllm.VllmConfig, "
            "local_rank: int, rank: int, distributed_init_method: str, "
            "is_driver_worker: bool = False) -> None"
        },
        why="Patches of one model runner's code must be applied only where "
        "that runner runs, and which one vLLM builds is known only from the "
        "finished config, which a process does not have when it loads plugins.",
        how="Before the original runs, applies the registry's patches whose "
        "runner is the one this config selects (VllmConfig.use_v2_model_runner) "
        "and, on CPU with a feature on, asks Linux for AMX tile state "
        "(device/cpu_amx.py: vLLM's bfloat16 attention uses AMX tiles it never "
        "asked for). Every worker class calls it, in-process or not, after "
        "vLLM loaded plugins in the worker's process; WorkerWrapperBase."
        "init_worker, patched before, is the call that loads them, so a "
        "spawned worker ran it unpatched.",
        remove_when="vLLM loads plugins with the config (or names the runner to them).",
    ),
    # The helper is defined in worker.utils and imported by name into each
    # runner, which calls its own binding: one entry per runner (vllm-ascend's
    # NPUModelRunner reaches the V1 binding through super()._update_states).
    *(
        Patch(
            target=f"{module}:copy_kv_cache_blocks_inplace",
            wrapper="vllm_kvreuse.device.block_copy:wrap_copy_kv_cache_blocks",
            kind="function",
            runner=runner,
            signatures={
                V0_32_0: "(kv_caches: collections.abc.Iterable[torch.Tensor], "
                "num_blocks: int, kv_cache_block_copies: collections.abc.Sequence["
                "vllm.v1.core.kv_cache_utils.KVCacheBlockCopy]) -> None"
            },
            why="Copy-on-write tails (continuation, beam forks, partial prefix "
            "hits) reach the workers as SchedulerOutput.kv_cache_block_copies, "
            "applied by this helper, which reads cache.device on each layer's "
            "entry: vllm-ascend keeps a layer's KV as a (k, v) tuple (V1 "
            "runner), so it raises AttributeError there; and on CPU (either "
            "runner) its batched index_put is element-wise.",
            how="Takes each layer's tensors (a tuple's members, a tensor as "
            "itself); on CPU, where the original's batched index_put is "
            "element-wise (30-75 ms for 128 blocks of 32 KiB, against 0.5 ms "
            "for one copy_ per block), copies block-major tensors block by "
            "block; passes the rest to the original.",
            remove_when="vLLM's helper accepts per-layer tuples of tensors and "
            "copies whole blocks on CPU.",
        )
        for module, runner in (
            ("vllm.v1.worker.gpu_model_runner", "v1"),
            ("vllm.v1.worker.gpu.model_runner", "v2"),
        )
    ),
)
