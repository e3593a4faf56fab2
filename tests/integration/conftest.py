"""Real in-process vLLM engines on the tiny model, shared per module."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from vllm import LLM
from vllm.v1.core.sched.scheduler import Scheduler

from tests.conftest import ENGINE_KWARGS


def scheduler_of(llm: LLM) -> Scheduler:
    """The engine core's scheduler (engines here run in-process)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def num_free_blocks(llm: LLM) -> int:
    return scheduler_of(llm).kv_cache_manager.block_pool.get_num_free_blocks()


def make_llm(model_dir: str, **kwargs) -> LLM:
    return LLM(model_dir, **{**ENGINE_KWARGS, "max_model_len": 1024, **kwargs})


@pytest.fixture
def no_leak(request) -> Iterator[None]:
    """Asserts every engine the test uses is back to its free-block count."""
    engines = [
        value
        for name in request.fixturenames
        if name not in ("no_leak", "request")
        and isinstance(value := request.getfixturevalue(name), LLM)
    ]
    before = [num_free_blocks(llm) for llm in engines]
    yield
    after = [num_free_blocks(llm) for llm in engines]
    assert after == before, "KV blocks leaked by this test"


@pytest.fixture(scope="module")
def hf_model(model_dir: str) -> Any:
    """The tiny model in Hugging Face transformers, float32, eager attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()
