"""The one list of features: adding a feature is its folder plus a line here.

Each entry is a feature folder's ``spec.SPEC``
(:class:`~vllm_kvreuse.core.spec.FeatureSpec`). Everything shared loops over
:data:`SPECS`: the settings (:mod:`vllm_kvreuse.config`), the flags and
engine hooks (:mod:`vllm_kvreuse.engine_args`), the request keys
(:mod:`vllm_kvreuse.request_args`), the frontend hooks
(:mod:`vllm_kvreuse.frontend`) and the scheduler features the hook layer
builds (:mod:`vllm_kvreuse.core.features`). A walkthrough with a test-only
feature: docs/architecture.md, "Adding a feature".

The order is the hook-call order, which matters only for broadcast hooks
that touch the same request:

- ``on_add``: the chunk cache first, because it re-salts a chunked request
  (its block hashes change) before anyone reads them;
- ``release_under_pressure``: beam search's held beams go before retained
  parents (a beam is needed for one more step, a parent maybe never);
- ``on_final_output`` (frontend): admission renames a rejection's finish
  reason before continuation records the parent's.

Frontend renderers have their own order (``render_order`` on the spec).

Exclusive hooks have one implementer by construction (tested).
"""

from __future__ import annotations

from vllm_kvreuse.admission.spec import SPEC as ADMISSION
from vllm_kvreuse.beam.spec import SPEC as BEAM
from vllm_kvreuse.chunk_cache.spec import SPEC as CHUNK_CACHE
from vllm_kvreuse.continuation.spec import SPEC as CONTINUATION
from vllm_kvreuse.core.spec import FeatureSpec

SPECS: tuple[FeatureSpec, ...] = (CHUNK_CACHE, ADMISSION, BEAM, CONTINUATION)
"""Every feature, in hook-call order."""

assert len({spec.name for spec in SPECS}) == len(SPECS), "two specs share a name"
