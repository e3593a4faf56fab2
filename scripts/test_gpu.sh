#!/usr/bin/env bash
# The GPU test tier: the engine-level tests (integration and e2e) and the
# device-kernel tests on a CUDA device, each test file in its own process
# (vLLM's memory profiling expects one engine per process and GPU), under
# both model runners: V2 (CUDA's default) and V1 (VLLM_USE_V2_MODEL_RUNNER=0).
# Without a CUDA device it says so and exits 0; CI stays on CPU and does not
# run it.
#
#   bash scripts/test_gpu.sh                   # every file, both runners
#   KVREUSE_GPU_RUNNERS=v1 bash scripts/test_gpu.sh   # one runner
#   bash scripts/test_gpu.sh tests/integration/test_chunk_cache_engine.py
#
# On a GPU machine without network, install vLLM 0.32.0's CUDA build first
# (../shared/gpu/make_bundle.sh, then `. /tmp/env.sh`) and run with PY=python3.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "no CUDA device: GPU tier skipped"
  exit 0
fi
export KVREUSE_GPU_TIER=1 VLLM_USE_FLASHINFER_SAMPLER=0
files=("$@")
if [[ ${#files[@]} -eq 0 ]]; then
  files=(tests/unit/test_device_*.py tests/integration/test_*.py tests/e2e/test_*.py)
fi
failed=()
for runner in ${KVREUSE_GPU_RUNNERS:-v2 v1}; do
  for file in "${files[@]}"; do
    echo "== [$runner runner] $file"
    # With KVREUSE_GPU_TIER, --runner sets VLLM_USE_V2_MODEL_RUNNER only.
    "$PY" -m pytest -q -p no:cacheprovider --runner "$runner" "$file" \
      || failed+=("$runner $file")
  done
done
if [[ ${#failed[@]} -gt 0 ]]; then
  printf 'failed: %s\n' "${failed[@]}"
  exit 1
fi
echo "GPU tier passed (${#files[@]} files per runner)"
