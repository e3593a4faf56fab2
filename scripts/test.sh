#!/usr/bin/env bash
# Sets up .venv/ (first run only), then runs the linter and the whole test
# suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
