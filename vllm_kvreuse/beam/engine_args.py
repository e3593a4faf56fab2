"""Engine beam search's engine arguments: the SID catalog's logits processor.

Called through the beam spec (:mod:`vllm_kvreuse.beam.spec`) by the generic
wrappers in :mod:`vllm_kvreuse.engine_args`. ``catalog.load`` is imported
only when called: loading the plugin must not import torch-heavy modules.
"""

from __future__ import annotations

from typing import Any

from vllm_kvreuse.core.spec import Settings, settings_of


def attach_catalog_processor(engine_args: Any, settings: Settings) -> None:
    """``--sid-catalog``: the catalog's logits processor."""
    from vllm_kvreuse.beam.catalog.load import attach_catalog_processor as attach

    attach(engine_args, settings)


def finalize_vllm_config(vllm_config: Any) -> None:
    """Refuses speculative decoding (a beam step runs in the sampler, which
    a speculative step replaces); the catalog processor of the runner vLLM
    will build (settled on the finished ``VllmConfig``)."""
    config = settings_of(vllm_config)
    if config.engine_beam_search and vllm_config.speculative_config is not None:
        raise ValueError(
            "--engine-beam-search does not run with speculative decoding: each "
            "beam step runs in vLLM's sampler, which a speculative step replaces"
        )
    if not config.sid_catalog:
        return
    from vllm_kvreuse.beam.catalog.load import select_catalog_processor

    select_catalog_processor(vllm_config)
