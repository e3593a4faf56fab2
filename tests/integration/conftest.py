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


_TOLERANCES: dict[int, float] = {}


def reference_tolerance(llm: LLM, hf_model: Any) -> float:
    """The log-prob tolerance of ``llm``'s comparisons with the Hugging Face
    reference (float32, on the CPU): 1e-3, or twice the most plain vLLM
    itself differs from the reference on this device over three ordinary
    prompts, whichever is larger (measured once per engine; the prefix
    cache is reset after it).

    Why: on a CPU the two agree to about 1e-6. A GPU's kernels round
    differently (1.9e-3 to 4.5e-3 on an H200 in float32, tokens equal), so
    a fixed 1e-3 there measures the device, not the plugin; comparisons
    with vLLM's own paths on the same device check the plugin exactly.
    """
    if id(llm) not in _TOLERANCES:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
        rounding = 0.0
        for length in (70, 130, 190):
            prompt = [(i * 37 + length) % 3000 + 100 for i in range(length)]
            llm.reset_prefix_cache()
            (out,) = llm.generate(
                [{"prompt_token_ids": prompt}], params, use_tqdm=False
            )
            with torch.no_grad():
                logits = hf_model(torch.tensor([prompt])).logits[0, -1]
            reference = torch.log_softmax(logits, dim=-1)
            first = out.outputs[0].logprobs[0].items()
            rounding = max(
                rounding, *(abs(e.logprob - float(reference[t])) for t, e in first)
            )
        llm.reset_prefix_cache()
        _TOLERANCES[id(llm)] = max(1e-3, 2 * rounding)
    return _TOLERANCES[id(llm)]
