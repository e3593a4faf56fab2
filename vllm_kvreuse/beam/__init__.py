"""Engine-side beam search: beams chosen next to the logits, carried by live members.

``spec.py``: the feature's declaration (settings, request keys, class,
the ``--sid-catalog`` setting); ``engine_args.py``: the catalog's logits
processor put in the engine arguments and settled on the finished config;
``metrics.py``: its counters in ``/metrics``.

Engine core (the serving path):

- ``feature.py``: the hook-layer feature: group lifecycle, steps;
- ``group.py``: a group's state, a beam's request;
- ``members.py``: a search's root and member requests, by id; spawning;
- ``live.py``: live beams, one engine request per beam for the whole search
  (the live step strategy);
- ``fork.py``: one new request per beam per step, ranked on the host (the
  fork step strategy);
- ``gate.py``: a step is admitted whole;
- ``policy.py``: vLLM's beam rule, free of scheduler state;
- ``policies.py``: plain beams or beams in a SID catalog, one object per group;
- ``catalog_policy.py``: the rule inside a SID catalog (host rows);
- ``plan.py``: a step's groups to the workers, their results back;
- ``result.py``: how the best beams reach the frontend.

Worker: ``select.py`` (a group's step next to the logits, torch),
``worker.py`` (a step's groups inside the sampler), ``runner_hooks.py``
(both runners' samplers run them: registered patches),
``catalog_processor.py`` (the catalog's logits mask, fork members). Frontend:
``frontend.py`` (online and offline entry points); ``body.py`` (the
request body's beam fields: strict booleans, ``sid_catalog``, the parent).
Catalog data:

- ``catalog.py``: the trie, as tensors;
- ``catalog_file.py``: the ``--sid-catalog`` file and its parser;
- ``catalog_setup.py``: loading it once per process and device.

Reference code, for tests and benchmarks only, lives in
:mod:`vllm_kvreuse.testing` (``testing/catalog_reference.py``: the dense
full-vocabulary constrained step).
"""
