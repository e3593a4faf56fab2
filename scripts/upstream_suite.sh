#!/usr/bin/env bash
# Runs vLLM's own scheduler and KV-connector unit tests (tests/v1/core and
# tests/v1/kv_connector/unit from the installed version's sdist) three ways:
# without the plugin, with it and every flag off, and with its scheduler
# features on; prints the tests that pass without the plugin but fail with it,
# and exits 1 if there are any. Needs the network once (pip download of the
# sdist, cached in build/upstream/) and takes long: not part of scripts/test.sh.
#
#   scripts/upstream_suite.sh                      # all three modes
#   scripts/upstream_suite.sh --modes off,flags-off
#   scripts/upstream_suite.sh -- tests/v1/core/test_scheduler.py -k diffusion
#   scripts/upstream_suite.sh --compare-only       # re-read the last results
#
# PYTHON selects the interpreter (default .venv/bin/python, which has vLLM).
# See docs/architecture.md, "Upstream test suite".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
exec "$PY" scripts/upstream_suite/run.py "$@"
