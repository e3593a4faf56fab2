"""Runs vLLM's own scheduler and KV-connector unit tests with and without the plugin.

Called by ``scripts/upstream_suite.sh``; see ``docs/architecture.md``
("Upstream test suite"). Steps:

1. ``pip download`` the sdist of the installed vLLM version (once) into the
   cache folder (``build/upstream/``), extract its ``tests/`` tree and
   ``pyproject.toml`` (vLLM's pytest markers), and install into
   ``<cache>/site`` (``pip install --target``, pinned as in vLLM's
   ``requirements/test/cpu.txt``) the few test-only packages the interpreter
   lacks; write config-only snapshots of the models the tests name into
   ``<cache>/hf`` (``fake_hub.py``), used offline.
2. Run the suite once per mode, each in its own pytest process with
   ``-p kvreuse_upstream_mode`` (see that file): ``off`` (plugin not
   loaded), ``flags-off`` (plugin loaded, defaults), ``features-on``.
3. Compare per-test outcomes from the junit XML files: a test that passes in
   ``off`` but fails or errors in another mode is a regression; exit 1 if
   there is any.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from prepare import (  # this folder is sys.path[0] when run as a script
    extract,
    fetch_sdist,
    install_test_packages,
    log,
    plugin_link,
    plugin_stub,
    vllm_version,
)

REPO = Path(__file__).resolve().parents[2]
HELPER_DIR = Path(__file__).resolve().parent
DEFAULT_PATHS = ("tests/v1/core", "tests/v1/kv_connector/unit")
MODES = ("off", "flags-off", "features-on")
BASELINE = "off"

# Tests left out in every mode alike. Only for tests that hang (a test that
# fails or is skipped without the plugin needs no entry: the comparison
# ignores it). Each entry: (node id prefix, why).
DESELECT: tuple[tuple[str, str], ...] = ()


@dataclass
class Run:
    mode: str
    wall_s: float = 0.0
    returncode: int | None = 0
    outcomes: dict[str, tuple[str, str]] = field(default_factory=dict)
    selection: str = ""
    report: dict = field(default_factory=dict)

    def totals(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for outcome, _ in self.outcomes.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        return counts


def patch_targets(results: Path) -> Path:
    """The targets of the registry's load-time patches as JSON, listed by a
    process that imports this checkout's plugin (the ``off`` mode's test
    process sees only the stub). Runner patches are left out: a worker
    applies them, and these tests build no worker."""
    path = results / "patch_targets.json"
    code = (
        "import json; from vllm_kvreuse.patches import PATCHES; "
        "print(json.dumps([p.target for p in PATCHES if p.runner is None]))"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, check=True, capture_output=True,
        text=True,
    ).stdout  # fmt: skip
    path.write_text(out.strip().splitlines()[-1])
    return path


def run_mode(
    mode: str, root: Path, results: Path, env_base: dict, args: argparse.Namespace
) -> Run:
    xml = results / f"{mode}.xml"
    report = results / f"{mode}.report.json"
    out = results / f"{mode}.log"
    for path in (xml, report):
        path.unlink(missing_ok=True)
    env = dict(env_base, KVREUSE_UPSTREAM_MODE=mode)
    env["KVREUSE_UPSTREAM_REPORT"] = str(report)
    env["KVREUSE_UPSTREAM_TARGETS"] = str(patch_targets(results))
    plugin = plugin_stub(args.cache) if mode == "off" else plugin_link(args.cache)
    env["PYTHONPATH"] = os.pathsep.join([str(plugin), env_base["PYTHONPATH"]])
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-c",
        str(root / "pyproject.toml"),
        "--rootdir",
        str(root),
        "-p",
        "no:cacheprovider",
        "-p",
        "kvreuse_upstream_mode",
        "-q",
        "-rfE",
        f"--timeout={args.timeout}",
        "--continue-on-collection-errors",
        "-o",
        "junit_family=xunit1",
        f"--junitxml={xml}",
    ]
    for node, _why in DESELECT:
        cmd.append(f"--deselect={node}")
    selection = args.pytest_args or list(DEFAULT_PATHS)
    cmd += selection
    (results / f"{mode}.selection").write_text(" ".join(selection) + "\n")
    log(f"mode {mode}: running pytest, output in {out}")
    start = time.monotonic()
    with out.open("w") as sink:
        proc = subprocess.run(cmd, cwd=root, env=env, stdout=sink, stderr=sink)
    run = Run(mode, wall_s=time.monotonic() - start, returncode=proc.returncode)
    (results / f"{mode}.wall_s").write_text(f"{run.wall_s:.1f} {run.returncode}\n")
    load_results(run, results)
    return run


def load_results(run: Run, results: Path) -> None:
    xml = results / f"{run.mode}.xml"
    report = results / f"{run.mode}.report.json"
    if report.exists():
        run.report = json.loads(report.read_text())
    selection = results / f"{run.mode}.selection"
    if selection.exists():
        run.selection = selection.read_text().strip()
    wall = results / f"{run.mode}.wall_s"
    if wall.exists() and not run.wall_s:
        wall_s, _, returncode = wall.read_text().partition(" ")
        run.wall_s = float(wall_s)
        run.returncode = int(returncode) if returncode.strip() else None
    if not xml.exists():
        return
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    for case in ET.parse(xml).getroot().iter("testcase"):
        file = case.get("file") or case.get("classname", "").replace(".", "/")
        cls = case.get("classname", "")
        # xunit1 classname is "tests.v1.core.test_x" or "...test_x.TestClass".
        module = file.removesuffix(".py").replace("/", ".")
        inner = cls[len(module) + 1 :] if cls.startswith(module + ".") else ""
        node = "::".join(p for p in (file, inner, case.get("name", "")) if p)
        outcome, message = "passed", ""
        for child in case:
            tag = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(
                child.tag
            )
            if tag and rank[tag] >= rank[outcome]:
                text = child.get("message") or (child.text or "")
                outcome, message = tag, (text.strip().splitlines() or [""])[0]
        previous = run.outcomes.get(node)
        if previous is None or rank[outcome] > rank[previous[0]]:
            run.outcomes[node] = (outcome, message)


def check_report(run: Run) -> list[str]:
    """Problems with how the mode was set up (empty when it was as asked)."""
    r = run.report
    if not r:
        return [f"{run.mode}: no mode report (pytest did not reach its end)"]
    problems = []
    if run.mode == "off":
        if not r.get("stub"):
            problems.append(
                f"off: vllm_kvreuse is not the stub: {r.get('plugin_path')}"
            )
        if r.get("patches_applied"):
            problems.append(f"off: patches applied: {r.get('patched_targets')}")
    else:
        missing = r.get("patches_missing") or r.get("patches_missing_at_end")
        if missing or not r.get("patches_applied"):
            problems.append(f"{run.mode}: plugin patches not applied: {missing}")
        plugin = r.get("plugin_path", "")
        if Path(plugin).resolve() != (REPO / "vllm_kvreuse").resolve():
            problems.append(f"{run.mode}: plugin loaded from {plugin}, not {REPO}")
    if run.mode == "features-on" and not r.get("rebound_scheduler_names"):
        problems.append("features-on: no scheduler name in the tests was rebound")
    return problems


def summarize(runs: list[Run]) -> int:
    print()
    print("== totals ==")
    for run in runs:
        totals = ", ".join(f"{k} {v}" for k, v in sorted(run.totals().items()))
        extra = ""
        if run.mode == "features-on" and run.report:
            extra = (
                f"; {run.report.get('configs_injected', 0)} VllmConfigs given "
                f"the features, {len(run.report.get('rebound_scheduler_names', []))}"
                " scheduler names rebound"
            )
        print(
            f"{run.mode:12} {len(run.outcomes):5} tests: {totals or 'none'} "
            f"(pytest exit {run.returncode}, {run.wall_s / 60:.1f} min{extra})"
        )
    problems = [p for run in runs for p in check_report(run)]
    base = next((r for r in runs if r.mode == BASELINE), None)
    regressions = 0
    if base is None:
        problems.append(f"no {BASELINE!r} run to compare with")
    else:
        for run in runs:
            if run is base:
                continue
            worse = sorted(
                (node, run.outcomes[node])
                for node, (outcome, _) in base.outcomes.items()
                if outcome == "passed"
                and node in run.outcomes
                and run.outcomes[node][0] in ("failed", "error")
            )
            # A run over other tests than the baseline's (a subset given after
            # --) is compared on the tests both ran.
            gone = sorted(
                node
                for node, (outcome, _) in base.outcomes.items()
                if outcome == "passed"
                and node not in run.outcomes
                and run.selection == base.selection
            )
            if run.selection != base.selection:
                print(f"-- {run.mode} ran: {run.selection}")
            print()
            print(f"== passing in {BASELINE}, failing in {run.mode}: {len(worse)} ==")
            for node, (outcome, message) in worse:
                print(f"{outcome.upper():6} {node}\n       {message[:300]}")
            if gone:
                print(f"-- passing in {BASELINE}, absent from {run.mode}: {len(gone)}")
                for node in gone:
                    print(f"       {node}")
            better = sum(
                1
                for node, (outcome, _) in run.outcomes.items()
                if outcome == "passed"
                and base.outcomes.get(node, ("",))[0] in ("failed", "error")
            )
            if better:
                print(f"-- failing in {BASELINE}, passing in {run.mode}: {better}")
            regressions += len(worse) + len(gone)
    for problem in problems:
        print(f"SETUP PROBLEM: {problem}")
    print()
    total = sum(r.wall_s for r in runs)
    print(f"wall time: {total / 60:.1f} min in all; regressions: {regressions}")
    return 1 if regressions or problems else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache",
        type=Path,
        default=REPO / "build" / "upstream",
        help="download, extract and results folder (default: build/upstream)",
    )
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated, from {','.join(MODES)} (default: all)",
    )
    parser.add_argument(
        "--results",
        type=Path,
        help="where junit XML, logs and reports go (default: <cache>/results)",
    )
    parser.add_argument(
        "--timeout", type=int, default=300, help="per-test timeout in seconds"
    )
    parser.add_argument(
        "--compare-only",
        action="store_true",
        help="compare the results of earlier runs without running pytest",
    )
    parser.add_argument(
        "pytest_args",
        nargs="*",
        help="test paths/options relative to the extracted sdist "
        f"(default: {' '.join(DEFAULT_PATHS)}); put them after --",
    )
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown mode(s) {sorted(unknown)}")
    cache = args.cache = args.cache.resolve()
    results = (args.results or cache / "results").resolve()
    results.mkdir(parents=True, exist_ok=True)

    if args.compare_only:
        runs = []
        for mode in modes:
            run = Run(mode)
            load_results(run, results)
            runs.append(run)
        return summarize(runs)

    version = vllm_version()
    root = extract(fetch_sdist(cache, version), cache, version)
    site = cache / "site"
    install_test_packages(root, site)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (site, HELPER_DIR))
    # Every plugin vLLM finds loads in every mode; only which vllm_kvreuse
    # the entry point reaches differs (see plugin_stub and plugin_link).
    env.pop("VLLM_PLUGINS", None)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # No hub here: configs come from a local cache, and nothing may wait on
    # the network (each miss would cost minutes of retries).
    sys.path.insert(0, str(HELPER_DIR))
    import fake_hub

    env["HF_HOME"] = str(fake_hub.build(cache / "hf"))
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env.pop("HF_HUB_CACHE", None)
    runs = [run_mode(mode, root, results, env, args) for mode in modes]
    return summarize(runs)


if __name__ == "__main__":
    sys.exit(main())
