#!/usr/bin/env bash
# Sets up .venv/ (first run only) and serves the default model,
# SmolLM2-135M-Instruct (models/smollm2, built by scripts/setup.sh), with
# every vllm-kvreuse feature on, then prints one example per feature (each
# works exactly as printed; tests/e2e/test_serve_script.py runs them). Extra
# arguments go to `vllm serve`, e.g.
#   bash scripts/serve.sh --global-cache-hit-threshold 0.5
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
MODEL=${KVREUSE_MODEL_DIR:-models/smollm2}
NAME=$(basename "$MODEL")
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}

# float32 for this 135M model's sake: in bfloat16 (vLLM's pick on a CPU with
# AVX512-BF16 or AMX) it answers the first example below wrongly ("What is
# the capital of France?" -> "L'Etoile, la Marseillaise, ..."). Every feature,
# the chunk cache included, also runs in bfloat16 (docs/chunk_cache.md);
# pass --dtype bfloat16 after the script's name to serve in it.
.venv/bin/vllm serve "$MODEL" --served-model-name "$NAME" \
  --host "$HOST" --port "$PORT" \
  --dtype float32 --enforce-eager --block-size 32 --max-model-len 4096 \
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
CHAT=http://$HOST:$PORT/v1/chat/completions
FOX="The quick brown fox jumps over the lazy dog. "
FOXES="${FOX}${FOX}${FOX}${FOX}${FOX}${FOX}${FOX}${FOX}"
# ChatML, SmolLM2's chat format, for requests that build their own prompt.
USER='<|im_start|>user\n'
END='<|im_end|>\n'
ASSISTANT='<|im_start|>assistant\n'
cat <<MSG

vllm-kvreuse is serving "$NAME" ($MODEL) at http://$HOST:$PORT/v1
with every feature on. Try each one;
a line "# expect: X" says that the answer contains X.

# The model: SmolLM2-135M-Instruct answers through its chat template.
curl -s $CHAT -H 'Content-Type: application/json' \\
  -d '{"model": "$NAME", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16, "temperature": 0}'
# expect: Paris

# Cache-hit threshold: a cold prompt is turned back before any KV is used ...
curl -s $URL -H 'Content-Type: application/json' \\
  -d '{"model": "$NAME", "prompt": "${FOXES}", "max_tokens": 8, "cache_hit_threshold": 0.5}'
# expect: "finish_reason":"cache_threshold"
# ... once it has run (threshold 0 admits it), most of it is cached and it is accepted.
curl -s $URL -H 'Content-Type: application/json' \\
  -d '{"model": "$NAME", "prompt": "${FOXES}", "max_tokens": 8, "cache_hit_threshold": 0}'
# expect: "finish_reason":"length"
curl -s $URL -H 'Content-Type: application/json' \\
  -d '{"model": "$NAME", "prompt": "${FOXES}", "max_tokens": 8, "cache_hit_threshold": 0.5}'
# expect: "finish_reason":"length"

# Two stages: stage 1 answers and keeps its KV; stage 2 continues that
# conversation by id (prefilling only the new turn) with engine-side beam
# search (the beams fork KV inside the engine).
ID=\$(curl -s $CHAT -H 'Content-Type: application/json' \\
  -d '{"model": "$NAME", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16, "temperature": 0, "retain_kv": true}' \\
  | python3 -c 'import json, sys; print(json.load(sys.stdin)["id"])')
curl -s $CHAT -H 'Content-Type: application/json' \\
  -d '{"model": "$NAME", "messages": [], "continuation_of": "'\$ID'", "continuation_suffix": "\n${USER}And the capital of Germany?${END}${ASSISTANT}", "max_tokens": 16, "use_beam_search": true, "n": 2}'
# expect: Berlin

# Chunk cache: a RAG request sends its segments as "chunks" (system prompt,
# documents, question); each document's KV is computed alone, cached by
# content and reused at any position. The second request finds both
# documents cached in another order ("cached_tokens").
curl -s $URL -H 'Content-Type: application/json' \\
  -d '{"model": "$NAME", "max_tokens": 24, "temperature": 0, "chunks": ["<|im_start|>system\nAnswer the question from the documents.${END}", "${USER}Document: The Vantor Bridge is in Oslo. It was built in 1873.${END}", "${USER}Document: The Kelmar Tower is in Lisbon. It is 120 metres tall.${END}", "${USER}In which city is the Kelmar Tower?${END}${ASSISTANT}"]}'
# expect: Lisbon
curl -s $URL -H 'Content-Type: application/json' \\
  -d '{"model": "$NAME", "max_tokens": 24, "temperature": 0, "chunks": ["<|im_start|>system\nAnswer the question from the documents.${END}", "${USER}Document: The Kelmar Tower is in Lisbon. It is 120 metres tall.${END}", "${USER}Document: The Vantor Bridge is in Oslo. It was built in 1873.${END}", "${USER}When was the Vantor Bridge built?${END}${ASSISTANT}"]}'
# expect: 1873
# The same through the chat API, as RAG frameworks send it: with
# "chunk_messages" every message before the last is a chunk, cut where the
# model's chat template renders it (no markers by hand). Its chunks are the
# ones the requests above stored ("cached_tokens").
curl -s $CHAT -H 'Content-Type: application/json' \\
  -d '{"model": "$NAME", "max_tokens": 24, "temperature": 0, "chunk_messages": true, "messages": [{"role": "system", "content": "Answer the question from the documents."}, {"role": "user", "content": "Document: The Kelmar Tower is in Lisbon. It is 120 metres tall."}, {"role": "user", "content": "Document: The Vantor Bridge is in Oslo. It was built in 1873."}, {"role": "user", "content": "When was the Vantor Bridge built?"}]}'
# expect: 1873

Press Ctrl-C to stop.
MSG
wait $server
