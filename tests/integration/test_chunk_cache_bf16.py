"""The chunk cache through a real vLLM engine in bfloat16 on CPU: the dtype
vLLM picks for a CPU with bfloat16 instructions, and with AMX tiles the
``amx`` KV packing (:mod:`vllm_kvreuse.device.cpu_amx`).

The other engine tests run float32, where greedy outputs match Hugging Face
exactly; here warm must equal cold, and moved chunks must answer as the
float32 reference within bfloat16's drift.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from vllm import LLM, SamplingParams, TokensPrompt
from vllm.distributed.kv_transfer import get_kv_transfer_group
from vllm.platforms import current_platform

from tests.conftest import ENGINE_KWARGS
from tests.integration.chunks import (
    DOC_A,
    DOC_B,
    QUESTION,
    SYSTEM,
    chunk_cache_llm,
    generate,
    index_of,
    stored_reference,
)
from tests.integration.conftest import make_llm
from vllm_kvreuse.device.cpu_amx import TiledKV

HAS_AMX = torch.cpu._is_amx_tile_supported()
pytestmark = [
    pytest.mark.usefixtures("no_leak"),
    pytest.mark.skipif(
        current_platform.is_cpu()
        and not (HAS_AMX or torch.cpu._is_avx512_bf16_supported()),
        reason="vLLM's CPU kernels run bfloat16 only with AVX512-BF16 or AMX "
        "(this CPU has neither)",
    ),
]


@pytest.mark.v1_only(
    "CI time: the worker asks for tile state before it builds either runner"
)
def test_a_first_prompt_of_a_few_tokens_runs(model_dir: str, monkeypatch) -> None:
    """A fresh worker whose first forward pass is a 4-token prompt: vLLM
    0.32's bfloat16 attention runs AMX tile instructions its process never
    asked Linux for, and died of SIGILL here before the plugin asked for
    them (``runners.prepare_cpu_worker``). The engine core is spawned, so
    no earlier test of this process has asked for them already."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    engine = make_llm(model_dir, dtype="bfloat16", enable_chunk_cache=True)
    try:
        prompt = TokensPrompt(prompt_token_ids=[100, 101, 102, 103])
        params = SamplingParams(max_tokens=2, temperature=0)
        (out,) = engine.generate([prompt], params, use_tqdm=False)
    finally:
        engine.llm_engine.engine_core.shutdown()
    assert len(out.outputs[0].token_ids) == 2


@pytest.fixture(scope="module")
def llm(model_dir: str) -> Iterator[LLM]:
    with chunk_cache_llm(model_dir, dtype="bfloat16") as engine:
        yield engine


@pytest.mark.skipif(
    ENGINE_KWARGS.get("tensor_parallel_size", 1) > 1 or not current_platform.is_cpu(),
    reason="reads the CPU worker's connector in this process",
)
def test_the_ops_address_the_packing_vllm_picked(llm) -> None:
    """AMX tiles where the CPU has them, vLLM's vec layout otherwise."""
    ops = get_kv_transfer_group().worker_side.ops
    assert ops.layers[0].keys.dtype == torch.bfloat16
    assert isinstance(ops.layers[0], TiledKV) == HAS_AMX


def test_warm_answers_as_cold_and_moved_chunks_as_the_reference(llm, hf_model) -> None:
    """Cold and warm agree token for token. Reordered behind a new system
    prompt, both documents come from the store, keys re-rotated (in float32,
    stored back in bfloat16), and the answer is the float32 reference's
    (each document as computed where first seen): its first token, and
    first-step log-probs within bfloat16 drift."""
    segments = [SYSTEM, DOC_A, DOC_B, QUESTION]
    cold = generate(llm, segments)
    warm = generate(llm, segments)
    assert warm.num_cached_tokens == len(SYSTEM + DOC_A + DOC_B)
    assert list(warm.outputs[0].token_ids) == list(cold.outputs[0].token_ids)

    stats = index_of(llm).stats
    hits = stats.hit_tokens
    reordered = [list(range(600, 620)), DOC_B, DOC_A, QUESTION]
    moved = generate(llm, reordered)
    assert stats.hit_tokens - hits == len(DOC_B) + len(DOC_A)
    assert moved.num_cached_tokens >= len(DOC_B) + len(DOC_A)
    expected, logprobs = stored_reference(hf_model, [segments], reordered, steps=1)
    assert moved.outputs[0].token_ids[0] == expected[0]
    for token, logprob in moved.outputs[0].logprobs[0].items():
        assert logprob.logprob == pytest.approx(float(logprobs[token]), abs=0.1)
