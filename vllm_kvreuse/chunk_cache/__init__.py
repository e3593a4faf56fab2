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

- ``feature.py``: the hook-layer feature: chunked requests and their fills;
- ``scheduler_side.py``: sole owner of the store index, and every plan;
- ``recompute.py``: which chunk tokens a request recomputes (heads, chunks
  chosen by the question, a tail), and its ``chunk_recompute`` field;
- ``store_admin.py``: the store's admin actions (stats, clear, pin, unpin);
- ``store.py``: the index: what is stored where, LRU order, pins, capacity;
- ``keys.py``: chunks' content keys, chunked requests' cache salt;
- ``fill_context.py``: the documents every chunk is computed after
  (``--chunk-fill-context``), tokenised once;
- ``plan.py``: the plan types the scheduler sends the workers;
- ``engine.py``: the engine-core utility behind the admin endpoint;
- ``stats.py``: chunk-store statistics on vLLM's KV-connector stats path.

The KV connector (scheduler and workers), and the workers:

- ``connector.py``: the thin KV-connector facade vLLM calls;
- ``worker_side.py``: stored chunk tensors, loads and saves;
- ``rope.py``: the model's RoPE, checked for exact re-rotation;
- ``cpu_cores.py``: CPU workers bind OpenMP threads as without a connector.
"""
