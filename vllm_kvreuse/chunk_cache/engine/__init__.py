"""The chunk cache in the engine core: the plans, the store (driven by the
hook-layer feature, :mod:`vllm_kvreuse.chunk_cache.feature`).

- ``planner.py``: every plan: loads, chunks computed in place, saves (the
  connector's scheduler side);
- ``placement.py``: how a request's chunks are placed (loaded, recomputed
  in part, computed in place and stored);
- ``rows.py``: a segmented request's whole prefill in one step, its
  computed spans as query rows of that step;
- ``store.py``: the store's owner: keys, pins, reservations, admin actions;
- ``index.py``: the index: what is stored where, LRU order, pins, capacity;
- ``tiers.py``: the tiers' sizes at start, a disk tier read back;
- ``keys.py``: chunks' content keys, stored chunks' origins, block salts;
- ``recompute.py``: which chunk tokens a request recomputes (heads, chunks
  chosen by the question, a tail), and its ``chunk_recompute`` field;
- ``plan.py``: a chunked request's plan (its chunks, spans, pins);
- ``said.py``: what a chunked request's response says
  (``kv_transfer_params``), its prefill steps counted;
- ``stats.py``: chunk-store statistics on vLLM's KV-connector stats path;
- ``admin.py``: the engine-core utility behind the admin endpoint.
"""
