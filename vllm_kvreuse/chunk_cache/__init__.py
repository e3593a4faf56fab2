"""Position-independent chunk cache (issue 5).

Four concepts, a sub-package each, and what they share:

- ``frontend/``: the API server's side: prompts split into segments, chunked
  chat completions, what a chunked request carries, the admin endpoint;
- ``engine/``: the engine core's side: the planner and its plans, the
  store, its index and keys, recomputed tokens, store statistics, the admin
  endpoint's utility;
- ``worker/``: the workers' side: stored chunk tensors, loads and saves, the
  model's RoPE;
- ``paths/``: answer paths (``--chunk-attention paths``) and their voting;
- ``tiers/``: the store's tiers below memory (disk, the shared store), as
  bytes both sides read: the blob format, files, the shared store's client.

Shared by them, at the top:

- ``spec.py``: the feature's declaration (settings, request keys, class);
- ``engine_args.py``: its KV connector in the engine arguments, alone or in a
  ``MultiConnector`` beside a user's;
- ``params.py``: what a chunked request carries in ``extra_args`` (written
  by the frontend, read by the feature);
- ``messages.py``: what the engine core's side sends the workers each step
  (store decisions, loads, saves) and what they report back; the two sides
  import it and nothing of each other;
- ``connector.py``: the thin KV-connector facade vLLM calls (scheduler and
  workers); its module path is the one users' kv-transfer configs name;
- ``feature.py``: the hook-layer feature in the engine core: chunked
  requests' plans (through the connector's scheduler side), segments.

CPU workers bind their OpenMP threads as without a connector
(:mod:`vllm_kvreuse.device.cpu_cores`: platform code, for every connector
of the plugin).
"""
