"""AsyncLLM.generate_continuation: a child that arrives while its parent runs."""

from __future__ import annotations

import asyncio

from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.v1.engine.async_llm import AsyncLLM

from tests.conftest import ENGINE_KWARGS

PROMPT = list(range(700, 790))
SUFFIX = [5, 6, 7]


async def last(generator, output=None):
    """The final output of ``generator`` (``output``: one already read)."""
    async for output in generator:  # noqa: B007 - the last one is kept
        pass
    return output


def test_child_waits_for_a_running_parent(model_dir: str) -> None:
    async def scenario():
        engine = AsyncLLM.from_engine_args(
            AsyncEngineArgs(
                model=model_dir,
                max_model_len=512,
                enable_continuation=True,
                **ENGINE_KWARGS,
            )
        )
        try:
            parent_params = SamplingParams(
                max_tokens=200, temperature=0.0, ignore_eos=True,
                extra_args={"retain_kv": True},
            )  # fmt: skip
            stream = engine.generate({"prompt_token_ids": PROMPT}, parent_params, "p")
            # The parent's first output is out and 199 tokens are left: it is
            # running, on a machine of any speed (no sleep to race).
            first = await anext(stream)
            assert not first.finished
            parent_task = asyncio.create_task(last(stream, first))
            child = await last(
                engine.generate_continuation(
                    "p", "c", SamplingParams(max_tokens=4, temperature=0.0), SUFFIX
                )
            )
            parent = await parent_task
            return parent, child
        finally:
            engine.shutdown()

    parent, child = asyncio.run(scenario())
    assert child.prompt_token_ids == PROMPT + list(parent.outputs[0].token_ids) + SUFFIX
    assert child.num_cached_tokens == len(child.prompt_token_ids) - len(SUFFIX) - 1
