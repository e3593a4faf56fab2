#!/usr/bin/env bash
# The GPU report: every GPU claim of the project measured in one run, within
# 8 minutes (docs/benchmarks.md, "On a GPU"). Writes OUT_DIR/report.md and
# its logs.
#
#   bash scripts/gpu_report.sh OUT_DIR              # a GPU machine
#   PY=python3 bash scripts/gpu_report.sh OUT_DIR   # after the offline bundle
#   bash scripts/gpu_report.sh OUT_DIR --dry-run    # CPU: every section, tiny sizes
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
exec "$PY" benchmarks/gpu_report.py "$@"
