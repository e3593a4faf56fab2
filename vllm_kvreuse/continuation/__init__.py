"""Continuation requests: a new request inherits a finished request's KV blocks.

- ``spec.py``: the feature's declaration (settings, request keys, class);
- ``metrics.py``: its counters in ``/metrics``;
- ``params.py``: the request options (``retain_kv``, ``retain_kv_ttl``);
- ``feature.py``: engine side, retention of finished parents in the ledger;
- ``engine.py``: engine-core utilities: release expired parents, find one;
- ``records.py``: engine-side records of finished requests, for children
  that reach another API-server process;
- ``registry.py``: the frontend's records of recent requests;
- ``remote.py``: look-ups across API-server processes, DP routing;
- ``frontend.py``: each engine client's registry, parents recorded,
  children built, the Python API (``generate_continuation``);
- ``serving.py``: the HTTP fields (``continuation_of``) and their renderers.
"""
