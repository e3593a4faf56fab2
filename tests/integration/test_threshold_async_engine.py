"""The cache-hit threshold through AsyncLLM, the engine behind `vllm serve`."""

from __future__ import annotations

import asyncio

from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM

from tests.conftest import ENGINE_KWARGS


async def collect(engine: AsyncLLM, request_id: str, prompt: list[int], **extra):
    params = SamplingParams(
        max_tokens=3,
        temperature=0.0,
        output_kind=RequestOutputKind.DELTA,
        extra_args=extra or None,
    )
    finish, num_tokens = None, 0
    async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id):
        num_tokens += len(out.outputs[0].token_ids)
        finish = out.outputs[0].finish_reason or finish
    return finish, num_tokens


def test_async_engine_rejects_then_serves(model_dir: str) -> None:
    async def scenario() -> list[tuple[str | None, int]]:
        args = AsyncEngineArgs(
            model=model_dir, max_model_len=512, global_cache_hit_threshold=0.3,
            **ENGINE_KWARGS,
        )  # fmt: skip
        engine = AsyncLLM.from_engine_args(args)
        try:
            prompt = list(range(1000, 1080))
            return [
                await collect(engine, "cold", prompt),
                await collect(engine, "seed", prompt, cache_hit_threshold=0),
                await collect(engine, "warm", prompt),
            ]
        finally:
            engine.shutdown()

    assert asyncio.run(scenario()) == [
        ("cache_threshold", 0),
        ("length", 3),
        ("length", 3),
    ]
