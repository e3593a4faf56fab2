"""Engine-side beam search: beams fork their parent beam's KV blocks.

Serving path, engine core: ``feature.py`` (the hook-layer feature: group
lifecycle, steps), ``group.py`` (a group's state, a beam's request),
``gate.py`` (a step is admitted whole), ``policy.py`` (vLLM's beam rule),
``catalog_policy.py`` (the rule inside a SID catalog), ``result.py`` (how
the best beams reach the frontend). Worker: ``catalog_processor.py`` (the
catalog's logits mask). Frontend: ``frontend.py``. Catalog data:
``catalog.py`` (trie tensors), ``catalog_file.py`` (the file),
``catalog_setup.py`` (loading it once per process).

Reference code, for tests and benchmarks only, lives in
:mod:`vllm_kvreuse.testing` (``catalog_reference.py``: the dense
full-vocabulary constrained step).
"""
