"""Engine beam search's declaration: its settings, request keys and class."""

from __future__ import annotations

from vllm_kvreuse.beam.rule import BeamConfig, parse_token_id
from vllm_kvreuse.core.options import Option, parse_bool, parse_file
from vllm_kvreuse.core.request_keys import BEAM, SID_EOS, SID_NODE
from vllm_kvreuse.core.spec import ArgKey, FeatureSpec

SPEC = FeatureSpec(
    name="beam",
    options=(
        Option(
            "engine_beam_search",
            parse_bool,
            False,
            "Run use_beam_search requests inside the engine: each beam step is "
            "chosen next to the logits on the workers, and width member "
            "requests carry the beams from the first step to the last (a moved "
            "beam's KV copied, not re-prefilled), with no front-end round trip "
            "between steps.",
        ),
        Option(
            "sid_catalog",
            parse_file,  # parsed where the engine starts (catalog.file.load_catalog)
            "",
            "SID catalog file (format: docs/sid_catalog.md), built at start-up "
            "into a trie that beam-search requests asking for it are constrained "
            "to. Empty (the default): no catalog.",
        ),
    ),
    keys=(
        ArgKey(
            BEAM,
            "beam",
            False,
            BeamConfig.parse_carried,
            "A beam-search root request's configuration.",
        ),
        ArgKey(
            SID_NODE, "beam", False, parse_token_id, "A catalog beam's SID trie node."
        ),
        ArgKey(
            SID_EOS,
            "beam",
            False,
            parse_token_id,
            "The token a catalog beam at a whole item may take (EOS).",
        ),
    ),
    switch="engine_beam_search",
    feature="vllm_kvreuse.beam.scheduler.feature:EngineBeamSearch",
    attach_engine_args="vllm_kvreuse.beam.engine_args:attach_catalog_processor",
    finalize_vllm_config="vllm_kvreuse.beam.engine_args:finalize_vllm_config",
    check_body="vllm_kvreuse.beam.body:check_body",
    to_beam_search_params="vllm_kvreuse.beam.body:to_beam_search_params",
)
