#!/usr/bin/env bash
# Sets up .venv/ (first run only) and serves the embedded default model with
# vllm-kvreuse on. Extra arguments go to `vllm serve`, e.g.
#   bash scripts/serve.sh --global-cache-hit-threshold 0.5
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
MODEL=${KVREUSE_MODEL_DIR:-models/tiny}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}

.venv/bin/vllm serve "$MODEL" --served-model-name tiny \
  --host "$HOST" --port "$PORT" \
  --enforce-eager --block-size 32 --max-model-len 2048 \
  --enable-prompt-tokens-details "$@" &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT INT TERM

until curl -sf "http://$HOST:$PORT/health" >/dev/null; do
  kill -0 $server 2>/dev/null || { echo "vllm serve exited" >&2; exit 1; }
  sleep 1
done
cat <<MSG

vllm-kvreuse is serving the random-weight model "tiny" at http://$HOST:$PORT/v1
(its output is meaningless text: the weights are random). Try:

  curl -s http://$HOST:$PORT/v1/completions -H 'Content-Type: application/json' \\
    -d '{"model": "tiny", "prompt": "Hello there", "max_tokens": 8, "cache_hit_threshold": 0.5}'

A cold prompt comes back with "finish_reason": "cache_threshold"; send one with
"cache_hit_threshold": 0 first and the same prompt is then accepted.
Press Ctrl-C to stop.
MSG
wait $server
