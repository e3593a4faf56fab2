"""The GPU report's correctness section: the engine tests that matter most.

A selection of the test suite's engine and kernel tests (device kernels,
the chunk cache's engine, segments and answer paths, continuation, the
cache-hit threshold, engine beam search, the SID catalog), each checked
against vLLM's own loop or a reference. On a GPU each file runs in a
process of its own (``KVREUSE_GPU_TIER``: fixed KV sizes, so the files run
at the same time, beside the report's servers starting), under the V2
model runner CUDA runs; on a CPU (the report's dry run) the same selection
runs in one process under the V1 runner. Every process is bounded by the
section's budget.

Tests may attach figures with pytest's ``record_property``; the section
prints them (the chunk load's rounding against vLLM's prefix cache).
"""

from __future__ import annotations

import re
import subprocess
import time
import xml.etree.ElementTree as ET
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

SELECTION: dict[str, list[str]] = {
    "tests/unit/test_device_triton.py": [],  # every test of the file
    "tests/unit/test_beam_step_no_sync.py": [],
    "tests/integration/test_chunk_cache_engine.py": [
        "test_a_request_of_new_chunks_is_computed_as_plain_vllm",
        "test_the_same_chunks_again_load_what_was_stored",
        "test_chunks_are_reused_in_new_company_and_new_ones_computed_in_place",
    ],
    "tests/integration/test_chunk_cache_segments.py": [
        "test_the_default_settings_match_the_hf_reference",
        "test_a_request_may_ask_for_no_recompute",
    ],
    "tests/integration/test_chunk_cache_paths.py": [
        "test_a_request_is_answered_on_its_likeliest_path",
    ],
    "tests/integration/test_continuation_engine.py": [
        "test_child_computes_suffix_plus_one_and_matches_full_recompute",
    ],
    "tests/integration/test_threshold_engine.py": [
        "test_cold_request_rejected_then_accepted_once_cached",
    ],
    "tests/integration/test_beam_search_engine.py": [
        "test_same_beams_as_vllm_offline_loop",
    ],
    "tests/integration/test_catalog_beams.py": [
        "test_every_constrained_beam_is_a_catalog_item",
        "test_a_full_width_search_ranks_every_item_as_the_model_does",
    ],
}
"""Test files and the tests run of each (empty: the whole file)."""
DRY_SELECTION: dict[str, list[str]] = {
    "tests/unit/test_device_triton.py": [
        "test_fused_ops_address_the_cpu_layout_and_split_kernel_blocks",
    ],
    "tests/integration/test_threshold_engine.py": [
        "test_cold_request_rejected_then_accepted_once_cached",
    ],
}
"""The dry run's selection: one kernel test and one engine test, enough to
prove the section runs tests and tabulates them (the suite runs the rest)."""

PARALLEL = 4
"""Test processes at a time on a GPU."""
OUTCOME = re.compile(r"^(tests/\S+?\.py)::\S+ (PASSED|FAILED|ERROR|SKIPPED|XFAIL)")


def node_ids(file: str, selection: dict[str, list[str]]) -> list[str]:
    return [f"{file}::{name}" for name in selection[file]] or [file]


@dataclass
class FileResult:
    """One test file's outcomes, figures recorded by its tests, and how its
    process ended."""

    file: str
    outcomes: Counter = field(default_factory=Counter)
    properties: list[str] = field(default_factory=list)
    seconds: float = 0.0
    note: str = ""


def run(
    python: str, log: Path, budget: float | None, gpu: bool, junit_dir: Path
) -> list[FileResult]:
    """Runs the selection (on a CPU, :data:`DRY_SELECTION`), bounded by
    ``budget`` seconds (None: not bounded); its output goes to ``log``, one
    table row a file."""
    selection = SELECTION if gpu else DRY_SELECTION
    results = {file: FileResult(file) for file in selection}
    if gpu:
        groups = [[file] for file in selection]
        args = ["--runner", "v2"]
        env = {"KVREUSE_GPU_TIER": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    else:
        groups = [list(selection)]
        args, env = ["--runner", "v1"], {}
    deadline = None if budget is None else time.monotonic() + budget
    # Four files at a time: the report's servers start beside them.
    with ThreadPoolExecutor(min(len(groups), PARALLEL)) as pool:
        outputs = list(
            pool.map(
                lambda files: _run_group(
                    python, files, args, env, deadline, junit_dir, selection
                ),
                groups,
            )
        )
    with open(log, "w") as out:
        for files, (text, seconds, note) in zip(groups, outputs, strict=True):
            out.write(f"==== {' '.join(files)} ({seconds:.0f} s{note})\n{text}\n")
            for line in text.splitlines():
                if match := OUTCOME.match(line):
                    results[match.group(1)].outcomes[match.group(2).lower()] += 1
            for file in files:
                results[file].seconds, results[file].note = seconds, note.lstrip(", ")
    for xml in junit_dir.glob("*.xml"):
        for case in ET.parse(xml).iter("testcase"):
            for prop in case.iter("property"):
                name = case.get("name")
                results[_file_of(case)].properties.append(
                    f"{name}: {prop.get('name')} = {prop.get('value')}"
                )
    return list(results.values())


def _run_group(
    python: str,
    files: list[str],
    args: list[str],
    env: dict[str, str],
    deadline: float | None,
    junit_dir: Path,
    selection: dict[str, list[str]],
) -> tuple[str, float, str]:
    import os

    budget = None if deadline is None else max(10.0, deadline - time.monotonic())
    junit = junit_dir / f"{Path(files[0]).stem}.xml"
    ids = [node for file in files for node in node_ids(file, selection)]
    cmd = [
        python,
        "-m",
        "pytest",
        "-v",
        "-p",
        "no:cacheprovider",
        *args,
        f"--junitxml={junit}",
        *ids,
    ]
    start = time.monotonic()
    try:
        done = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=budget,
            env={**os.environ, **env},
        )
        text, note = done.stdout + done.stderr, ""
        if done.returncode not in (0, 1):
            note = f", exit {done.returncode}"
    except subprocess.TimeoutExpired as expired:
        text = _text(expired.stdout) + _text(expired.stderr)
        note = f", cut at {budget:.0f} s"
    return text, time.monotonic() - start, note


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def _file_of(case: ET.Element) -> str:
    """The test file of a JUnit test case (its class name is the module)."""
    return case.get("classname", "").replace(".", "/") + ".py"


def markdown(results: list[FileResult]) -> str:
    lines = [
        "| test file | passed | failed | errors | skipped | seconds | note |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        counts = [r.outcomes[k] for k in ("passed", "failed", "error", "skipped")]
        lines.append(
            f"| {r.file} | "
            + " | ".join(map(str, counts))
            + f" | {r.seconds:.0f} | {r.note} |"
        )
    figures = [p for r in results for p in r.properties]
    if figures:
        lines += ["", "Figures the tests recorded:", ""]
        lines += [f"- {p}" for p in figures]
    return "\n".join(lines)
