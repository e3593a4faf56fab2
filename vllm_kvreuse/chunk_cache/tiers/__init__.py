"""The chunk store's tiers below memory, shared by the engine core (which
decides) and the workers (which move the bytes).

- ``codec.py``: a stored chunk as one blob (header, checksum, raw bytes),
  its meta, the store's fingerprint;
- ``identity.py``: what stored bytes belong to: the model identity in
  every chunk key, the store's fingerprint, the store key;
- ``opening.py``: the tiers opened from the settings, by the engine core
  (to find chunks) and by each worker (to move their bytes);
- ``disk.py``: the disk tier: files that outlive the server;
- ``shared.py``: the shared store several servers use (Valkey or Redis);
- ``urls.py``: the shared store's URL, checked at start and shown redacted.
"""
