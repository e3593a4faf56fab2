"""Cache-hit threshold: admission control for P/D-disaggregated serving.

- ``spec.py``: the feature's declaration (setting, request key, class);
- ``metrics.py``: its counter in ``/metrics`` (rejections by stage);
- ``policy.py``: the threshold rule, free of vLLM internals;
- ``feature.py``: the rule as a scheduler feature;
- ``frontend.py``: the request field in, the finish reason out;
- ``streaming.py``: the ``cache_threshold`` chunk that ends a stream, even
  when nothing was generated.
"""
