"""Real in-process vLLM engines on the tiny model, shared per module."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from vllm import LLM
from vllm.v1.core.sched.scheduler import Scheduler

from tests.conftest import ENGINE_KWARGS
from vllm_kvreuse.core.accounting import check_block_accounting


def scheduler_of(llm: LLM) -> Scheduler:
    """The engine core's scheduler (engines here run in-process)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def num_free_blocks(llm: LLM) -> int:
    return scheduler_of(llm).kv_cache_manager.block_pool.get_num_free_blocks()


def make_llm(model_dir: str, **kwargs) -> LLM:
    return LLM(model_dir, **{**ENGINE_KWARGS, "max_model_len": 1024, **kwargs})


def _engines(request) -> list[LLM]:
    """The engines among the test's fixture values (set up already)."""
    return [value for value in request.node.funcargs.values() if isinstance(value, LLM)]


@pytest.fixture
def no_leak(request) -> Iterator[None]:
    """Asserts every engine the test uses is back to its free-block count."""
    engines = _engines(request)
    before = [num_free_blocks(llm) for llm in engines]
    yield
    after = [num_free_blocks(llm) for llm in engines]
    assert after == before, "KV blocks leaked by this test"


@pytest.fixture(autouse=True)
def block_accounting(request) -> Iterator[None]:
    """After every test, every KV block reference of every engine it used is
    owned: by a live request, the plugin's ledger, or a deferred free."""
    yield
    for llm in _engines(request):
        check_block_accounting(scheduler_of(llm))


@pytest.fixture(scope="module")
def hf_model(model_dir: str) -> Any:
    """The tiny model in Hugging Face transformers, float32, eager attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()
