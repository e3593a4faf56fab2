"""Real vLLM schedulers and requests, built without an engine or a model run."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tests.conftest import BLOCK_SIZE
from vllm_kvreuse.config import ADDITIONAL_CONFIG_KEY
from vllm_kvreuse.core.accounting import check_block_accounting

SchedulerFactory = Callable[..., Scheduler]


@pytest.fixture(scope="session")
def model_config(model_dir: str) -> ModelConfig:
    return ModelConfig(model=model_dir, dtype="float32", skip_tokenizer_init=True)


ALL_SCHEDULER_FEATURES = dict(
    enable_continuation=True, engine_beam_search=True, global_cache_hit_threshold=0.0
)
"""The features that need no KV connector, on; tests override single values."""


@pytest.fixture
def make_scheduler(model_config: ModelConfig) -> Iterator[SchedulerFactory]:
    """Builds the scheduler class vLLM would pick, through the plugin's patch,
    with every connector-free feature on unless ``plugin=False``; after the
    test, every scheduler it made passes the block-accounting check."""
    made: list[Scheduler] = []

    def make(num_blocks: int = 64, plugin: bool = True, **kvreuse: Any) -> Scheduler:
        if plugin:
            kvreuse = {**ALL_SCHEDULER_FEATURES, **kvreuse}
        vllm_config = VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig.default_factory(
                max_num_seqs=16,
                max_num_batched_tokens=4096,
                max_model_len=2048,
                async_scheduling=False,
            ),
            additional_config={ADDITIONAL_CONFIG_KEY: kvreuse} if kvreuse else {},
        )
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        spec = FullAttentionSpec(
            BLOCK_SIZE, num_kv_heads=1, head_size=32, dtype=model_config.dtype
        )
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
        )
        scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
        scheduler = scheduler_cls(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=BLOCK_SIZE,
            log_stats=True,
        )
        made.append(scheduler)
        return scheduler

    yield make
    for scheduler in made:
        check_block_accounting(scheduler)


_hasher = None


def make_request(
    request_id: str,
    prompt: Sequence[int],
    max_tokens: int = 4,
    cache_salt: str | None = None,
    **extra_args: Any,
) -> Request:
    global _hasher
    if _hasher is None:
        init_none_hash(sha256)
        _hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    params = SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args or None
    )
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=params,
        pooling_params=None,
        cache_salt=cache_salt,
        block_hasher=_hasher,
    )


def model_output(output: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """What a model run would return: one sampled token per finished prefill."""
    req_ids = list(output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=[[token] for _ in req_ids],
    )


def step(scheduler: Scheduler) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One engine step: schedule, fake model run, update; returns both sides."""
    output = scheduler.schedule()
    engine_outputs: dict[int, EngineCoreOutputs] = scheduler.update_from_output(
        output, model_output(output)
    )
    return output, [o for eco in engine_outputs.values() for o in eco.outputs]


def run_to_completion(
    scheduler: Scheduler, max_steps: int = 100
) -> list[EngineCoreOutput]:
    """Steps until no request is left; returns every output produced."""
    outputs: list[EngineCoreOutput] = []
    for _ in range(max_steps):
        if not scheduler.has_requests():
            return outputs
        outputs += step(scheduler)[1]
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def preempt(scheduler: Scheduler, request: Request) -> None:
    """Preempts a running request with upstream's own method."""
    scheduler.running.remove(request)
    scheduler._preempt_request(request, time.monotonic())


def num_free_blocks(scheduler: Scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
