"""The beam-search fields of an OpenAI request body (completions and chat).

The spec's ``check_body`` and ``to_beam_search_params`` hooks, called from
the shared request models (:mod:`vllm_kvreuse.frontend`):

- ``use_beam_search`` and ``sid_catalog`` must be JSON booleans, checked
  before pydantic reads the body;
- ``sid_catalog``, and the parent a continuation resolved to, are carried
  into the ``BeamSearchParams`` vLLM builds from the request.
"""

from __future__ import annotations

from typing import Any

from vllm_kvreuse.beam.frontend import mark_catalog_params, mark_parent_params
from vllm_kvreuse.core.request_keys import PARENT

SID_CATALOG = "sid_catalog"
"""Body field: constrain the beams to the server's SID catalog."""

STRICT_BOOLS = ("use_beam_search", SID_CATALOG)
"""Body fields that must be JSON booleans: pydantic would read ``"yes"`` as
true, and engine-side beam search then serves a request the client may not
have meant."""


def check_body(data: Any) -> None:
    """Raises ``ValueError`` (HTTP 400) for a non-boolean :data:`STRICT_BOOLS`
    field, or ``sid_catalog`` without ``use_beam_search``."""
    if not isinstance(data, dict):
        return
    for name in STRICT_BOOLS:
        value = data.get(name)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
    if data.get(SID_CATALOG) and not data.get("use_beam_search"):
        raise ValueError(f"{SID_CATALOG} applies to use_beam_search requests")


def to_beam_search_params(request: Any, params: Any) -> Any:
    """Carries the body's ``sid_catalog``, and the parent a continuation
    resolved to, into the ``BeamSearchParams``."""
    if (request.model_extra or {}).get(SID_CATALOG):
        mark_catalog_params(params)
    parent = (getattr(request, "vllm_xargs", None) or {}).get(PARENT)
    if parent is not None:
        mark_parent_params(params, parent)
    return params
