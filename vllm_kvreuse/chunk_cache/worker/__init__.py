"""The chunk cache in the workers (the connector's worker side).

- ``chunks.py``: stored chunk tensors, loads and saves;
- ``rope.py``: the model's RoPE, checked for exact re-rotation.
"""
