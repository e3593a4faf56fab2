"""Position-independent chunk cache (issue 5).

Four concepts, a sub-package each:

- ``frontend/``: the API server's side: prompts split into segments, chunked
  chat completions, what a chunked request carries, the admin endpoint;
- ``engine/``: the engine core's side: the hook-layer feature, the planner
  and its plans, the store, its index and keys, recomputed tokens, store
  statistics, the admin endpoint's utility;
- ``worker/``: the workers' side: stored chunk tensors, loads and saves, the
  model's RoPE;
- ``paths/``: answer paths (``--chunk-attention paths``) and their voting.

At the top, shared by them:

- ``spec.py``: the feature's declaration (settings, request keys, class);
- ``engine_args.py``: its KV connector in the engine arguments, alone or in a
  ``MultiConnector`` beside a user's;
- ``connector.py``: the thin KV-connector facade vLLM calls (scheduler and
  workers); its module path is the one users' kv-transfer configs name.

CPU workers bind their OpenMP threads as without a connector
(:mod:`vllm_kvreuse.device.cpu_cores`: platform code, for every connector
of the plugin).
"""
