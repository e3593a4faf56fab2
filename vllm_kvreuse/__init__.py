"""vllm-kvreuse: a vLLM plugin that reuses KV cache where vLLM throws it away.

vLLM calls :func:`register` (entry point group ``vllm.general_plugins``) in
every process it starts: API server, engine core and workers.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Checks the vLLM version and applies the patch registry; safe to call twice.

    vLLM loads general plugins inside ``EngineArgs``, after it has checked
    its keyword arguments, so ``LLM(..., global_cache_hit_threshold=0.5)``
    needs this called once beforehand; ``additional_config={"kvreuse":
    {...}}`` works without it.
    """
    from vllm_kvreuse.compat import check_vllm_version
    from vllm_kvreuse.engine_args import register_features
    from vllm_kvreuse.patches import apply_all

    check_vllm_version()
    apply_all()
    # E.g. the chunk cache's connector by name, so a MultiConnector holding
    # it can rebuild its stats.
    register_features()
