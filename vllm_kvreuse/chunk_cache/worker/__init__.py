"""The chunk cache in the workers (the connector's worker side).

- ``chunks.py``: stored chunk tensors, loads and saves;
- ``tiers.py``: the stored chunks across memory, disk and the shared store;
- ``rope.py``: the model's RoPE, checked for exact re-rotation.
"""
