"""Engine-side beam search: beams chosen next to the logits, carried by live members.

Three concepts, a sub-package each, and what they share:

- ``scheduler/``: the hook-layer feature in the engine core: groups,
  their members and steps (live or fork), admission of a step as a whole;
- ``worker/``: a step's groups inside the workers' samplers, next to the
  logits (torch), and the runners' patches that run them;
- ``catalog/``: the semantic-ID catalog: its trie, file, loading, the rule
  inside it and its logits mask.

Shared by them:

- ``spec.py``: the feature's declaration (settings, request keys, class,
  the ``--sid-catalog`` setting);
- ``engine_args.py``: the catalog's logits processor put in the engine
  arguments and settled on the finished config;
- ``rule.py``: vLLM's beam rule and ``BeamConfig``, free of scheduler state;
- ``plan.py``: a step's groups to the workers, their results back;
- ``result.py``: how the best beams reach the frontend;
- ``metrics.py``: its counters in ``/metrics``.

Frontend: ``frontend.py`` (online and offline entry points); ``answers.py``
(the engine's beams as vLLM's beam-search outputs); ``body.py`` (the
request body's beam fields: strict booleans, ``sid_catalog``, the parent).

Reference code, for tests and benchmarks only, lives in
:mod:`vllm_kvreuse.testing` (``testing/catalog_reference.py``: the dense
full-vocabulary constrained step).
"""
