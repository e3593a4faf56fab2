"""Position-independent chunk cache (issue 5).

``spec.py``: the feature's declaration (settings, request keys, class);
``engine_args.py``: its KV connector in the engine arguments, alone or in a
``MultiConnector`` beside a user's.

Frontend:

- ``frontend.py``: prompts split into segments, the ``chunks`` field;
- ``chat.py``: chunked chat completions (``chunk_messages``, the separator,
  ``documents``) through the model's chat template;
- ``chat_split.py``: where a rendered chat is cut, and the check that its
  pieces' tokens are vLLM's;
- ``params.py``: what a chunked request carries in ``extra_args``;
- ``admin.py``: the admin endpoint, as a vLLM endpoint plugin.

Scheduler (engine core):

- ``feature.py``: the hook-layer feature: chunked requests' plans, segments;
- ``scheduler_side.py``: every plan: loads, chunks computed in place, saves;
- ``store.py``: the store's owner: keys, pins, reservations, admin actions;
- ``paths.py``: answer paths (``--chunk-attention paths``): each document
  on its own exact prefix, scored by the question's likelihood;
- ``voting.py``: the paths' scoring requests, and the request parked until
  its likeliest path becomes its prompt;
- ``recompute.py``: which chunk tokens a request recomputes (heads, chunks
  chosen by the question, a tail), and its ``chunk_recompute`` field;
- ``index.py``: the index: what is stored where, LRU order, pins, capacity;
- ``keys.py``: chunks' content keys, stored chunks' origins, block salts;
- ``plan.py``: the plan types the scheduler sends the workers;
- ``engine.py``: the engine-core utility behind the admin endpoint;
- ``stats.py``: chunk-store statistics on vLLM's KV-connector stats path.

The KV connector (scheduler and workers), and the workers:

- ``connector.py``: the thin KV-connector facade vLLM calls;
- ``worker_side.py``: stored chunk tensors, loads and saves;
- ``rope.py``: the model's RoPE, checked for exact re-rotation.

CPU workers bind their OpenMP threads as without a connector
(:mod:`vllm_kvreuse.device.cpu_cores`: platform code, for every connector
of the plugin).
"""
