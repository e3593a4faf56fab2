#!/usr/bin/env bash
# Sets up .venv/ (first run only) and serves the embedded default model with
# every vllm-kvreuse feature on, then prints one example per feature (each
# works exactly as printed; tests/e2e/test_serve_script.py runs them). Extra
# arguments go to `vllm serve`, e.g.
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
  --enable-prompt-tokens-details \
  --global-cache-hit-threshold 0 --enable-continuation \
  --engine-beam-search --enable-chunk-cache "$@" &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT INT TERM

until curl -sf "http://$HOST:$PORT/health" >/dev/null; do
  kill -0 $server 2>/dev/null || { echo "vllm serve exited" >&2; exit 1; }
  sleep 1
done
URL=http://$HOST:$PORT/v1/completions
FOX="The quick brown fox jumps over the lazy dog. "
cat <<MSG

vllm-kvreuse is serving the random-weight model "tiny" at http://$HOST:$PORT/v1
(its output is meaningless text: the weights are random). Try each feature;
a line "# expect: X" says that the answer contains X.

# Cache-hit threshold: a cold prompt is turned back before any KV is used ...
curl -s $URL -H 'Content-Type: application/json' \\
  -d '{"model": "tiny", "prompt": "${FOX}${FOX}${FOX}", "max_tokens": 8, "cache_hit_threshold": 0.5}'
# expect: "finish_reason":"cache_threshold"
# ... once it has run (threshold 0 admits it), most of it is cached and it is accepted.
curl -s $URL -H 'Content-Type: application/json' \\
  -d '{"model": "tiny", "prompt": "${FOX}${FOX}${FOX}", "max_tokens": 8, "cache_hit_threshold": 0}'
# expect: "finish_reason":"length"
curl -s $URL -H 'Content-Type: application/json' \\
  -d '{"model": "tiny", "prompt": "${FOX}${FOX}${FOX}", "max_tokens": 8, "cache_hit_threshold": 0.5}'
# expect: "finish_reason":"length"

# Continuation: stage 1 keeps its KV; stage 2 continues it by id and computes only its suffix.
ID=\$(curl -s $URL -H 'Content-Type: application/json' \\
  -d '{"model": "tiny", "prompt": "Think about a gift:", "max_tokens": 16, "retain_kv": true}' \\
  | python3 -c 'import json, sys; print(json.load(sys.stdin)["id"])')
curl -s $URL -H 'Content-Type: application/json' \\
  -d '{"model": "tiny", "continuation_of": "'\$ID'", "continuation_suffix": " Answer:", "max_tokens": 8}'
# expect: "cached_tokens"

# Engine-side beam search: one request, the beams fork KV inside the engine.
curl -s $URL -H 'Content-Type: application/json' \\
  -d '{"model": "tiny", "prompt": "Recommend:", "max_tokens": 3, "use_beam_search": true, "n": 4}'
# expect: "index":3

# Chunk cache: segments separated by ## are cached by content and reused at any position.
curl -s $URL -H 'Content-Type: application/json' \\
  -d '{"model": "tiny", "prompt": "You are helpful.##Paris is in France.##Berlin is in Germany.##Which is older?", "max_tokens": 8}'
# expect: "finish_reason":"length"

Press Ctrl-C to stop.
MSG
wait $server
