"""Where the SID catalog is loaded, once per process and device.

Both sides need it: the scheduler (to move each beam down the trie) and the
workers' logits processor (to mask each beam's row). Each loads the file
named by ``--sid-catalog`` at start-up; a process that is both (an offline
engine, the CPU build's in-process worker) loads it once per device.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_kvreuse.beam.catalog.file import load_catalog
from vllm_kvreuse.beam.catalog.trie import SidCatalog
from vllm_kvreuse.core.spec import Settings, settings_of

__all__ = [
    "PROCESSOR",
    "PROCESSOR_V2",
    "engine_catalog",
    "select_catalog_processor",
]

PROCESSOR = "vllm_kvreuse.beam.catalog.processor:CatalogLogitsProcessor"
"""The catalog mask for vLLM's V1 model runner (what ``--sid-catalog`` adds)."""
PROCESSOR_V2 = "vllm_kvreuse.beam.catalog.processor:CatalogLogitsProcessorV2"
"""The same mask for the V2 model runner, which loads only processors of its
own interface (``vllm.v1.worker.gpu.sample.logits_processor``)."""


def engine_catalog(vllm_config: Any, device: torch.device | str) -> SidCatalog | None:
    """The catalog of ``--sid-catalog`` on ``device``; None when unset."""
    path = settings_of(vllm_config).sid_catalog
    if not path:
        return None
    model_config = vllm_config.model_config
    key = (path, str(model_config.model), str(device))
    if key not in _loaded:
        _loaded[key] = _load(path, model_config, device)
    return _loaded[key]


# Per process on purpose: the scheduler feature, the workers' logits processor
# and the frontend are separate objects vLLM builds, with no common owner; in
# one process (an offline engine, the CPU in-process worker) they share a copy.
_loaded: dict[tuple[str, str, str], SidCatalog] = {}


def _load(path: str, model_config: Any, device: torch.device | str) -> SidCatalog:
    from vllm.tokenizers import cached_tokenizer_from_config

    tokenizer = cached_tokenizer_from_config(model_config)
    return load_catalog(
        path,
        model_config.get_vocab_size(),
        vocab=tokenizer.get_vocab() if tokenizer is not None else None,
        eos_token_id=tokenizer.eos_token_id if tokenizer is not None else None,
        device=device,
    )


def attach_catalog_processor(engine_args: Any, config: Settings) -> None:
    """With ``--sid-catalog`` (in ``config``, the settings folded into
    ``engine_args``), adds the catalog's logits processor and checks that
    vLLM returns processed log-probs (what the processor shapes)."""
    if not config.sid_catalog:
        return
    if not config.engine_beam_search:
        raise ValueError("--sid-catalog needs --engine-beam-search")
    if engine_args.logprobs_mode != "processed_logprobs":
        raise ValueError(
            "--sid-catalog needs --logprobs-mode processed_logprobs: catalog "
            "beams read each beam's log-probs after the catalog mask (the "
            "mask keeps every log-prob exact; see docs/sid_catalog.md)"
        )
    processors = list(engine_args.logits_processors or [])
    if PROCESSOR not in processors:
        engine_args.logits_processors = [*processors, PROCESSOR]


def select_catalog_processor(vllm_config: Any) -> None:
    """Names the catalog processor of the runner this engine will build.

    Engine arguments cannot know the runner: vLLM picks it from the finished
    config (``VllmConfig.use_v2_model_runner``: the environment, Triton,
    unsupported features). So ``--sid-catalog`` adds the V1 processor, and
    this runs at the end of ``VllmConfig.__post_init__`` (in the process that
    builds the config; the result travels to every process with it), swapping
    in the V2 one when V2 will run. Idempotent.
    """
    model_config = getattr(vllm_config, "model_config", None)
    processors = list(getattr(model_config, "logits_processors", None) or ())
    if PROCESSOR not in processors or not vllm_config.use_v2_model_runner:
        return
    model_config.logits_processors = [
        PROCESSOR_V2 if name == PROCESSOR else name for name in processors
    ]
