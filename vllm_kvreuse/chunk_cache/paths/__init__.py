"""Answer paths (``--chunk-attention paths``).

- ``modes.py``: each document on its own exact prefix, scored by the
  question's likelihood; the ``chunk_attention`` modes and field;
- ``voting.py``: the paths' scoring requests, and the request parked until
  its likeliest path becomes its prompt.
"""
