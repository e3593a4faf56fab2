"""The semantic-ID (SID) catalog beams may be constrained to (``--sid-catalog``).

- ``trie.py``: the catalog as a trie of tensors;
- ``file.py``: the catalog file's format and its parser;
- ``load.py``: where the catalog is loaded, once per process and device,
  and which logits processor masks it;
- ``rule.py``: the beam rule inside the catalog (host rows);
- ``processor.py``: the catalog's logits mask (V1 and V2 runners).
"""
