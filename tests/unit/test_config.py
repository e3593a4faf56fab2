"""Settings: validation, CLI flags on vLLM's real parser, EngineArgs folding."""

from __future__ import annotations

import importlib
import math
from dataclasses import fields
from pathlib import Path

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

import vllm_kvreuse
from vllm_kvreuse.config import (
    ADDITIONAL_CONFIG_KEY,
    OPTIONS,
    KVReuseConfig,
    merge_settings,
    parse_fraction,
)
from vllm_kvreuse.core.features import feature_class
from vllm_kvreuse.features import SPECS


@pytest.mark.parametrize("value", [0, 0.0, 0.5, 1, "0.25", "1.0"])
def test_parse_fraction_accepts_numbers_in_unit_interval(value) -> None:
    assert parse_fraction(value, "x") == float(value)


@pytest.mark.parametrize(
    "value", [-0.01, 1.01, math.nan, math.inf, "abc", None, True, [0.5], {}]
)
def test_parse_fraction_refuses_everything_else(value) -> None:
    with pytest.raises(ValueError, match=r"x must be a number in \[0, 1\]"):
        parse_fraction(value, "x")


def test_config_defaults_change_nothing() -> None:
    assert KVReuseConfig() == KVReuseConfig.from_dict({})
    assert KVReuseConfig().global_cache_hit_threshold is None
    assert KVReuseConfig().enabled == {"core"}


@pytest.mark.parametrize(
    ("settings", "feature"),
    [
        ({"global_cache_hit_threshold": 0.0}, "admission"),
        ({"enable_continuation": True}, "continuation"),
        ({"engine_beam_search": True}, "beam"),
        ({"enable_chunk_cache": True}, "chunk_cache"),
    ],
)
def test_each_switch_turns_on_its_feature_alone(settings, feature) -> None:
    assert KVReuseConfig.from_dict(settings).enabled == {"core", feature}


def test_every_feature_folder_has_one_spec_in_the_list() -> None:
    """A folder with a ``spec.py`` is a feature, and ``SPECS`` holds its
    ``SPEC``; its scheduler class answers to the spec's name."""
    package = Path(vllm_kvreuse.__file__).parent
    folders = {path.parent.name for path in package.glob("*/spec.py")} - {"core"}
    assert sorted(spec.name for spec in SPECS) == sorted(folders)
    for name in folders:
        spec = importlib.import_module(f"vllm_kvreuse.{name}.spec").SPEC
        assert spec in SPECS and spec.name == name
        assert feature_class(spec).name == name


def test_config_fields_are_the_specs_options_with_their_defaults() -> None:
    assert [(f.name, f.default) for f in fields(KVReuseConfig)] == [
        (option.name, option.default) for option in OPTIONS
    ]
    assert [o.name for o in OPTIONS] == [o.name for s in SPECS for o in s.options]


def test_unknown_setting_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown vllm-kvreuse setting"):
        KVReuseConfig.from_dict({"global_cache_hit_treshold": 0.5})


def test_merge_settings_keeps_other_keys_and_validates() -> None:
    merged = merge_settings({"other": 1}, {"global_cache_hit_threshold": 0.3})
    assert merged == {
        "other": 1,
        ADDITIONAL_CONFIG_KEY: {"global_cache_hit_threshold": 0.3},
    }
    with pytest.raises(ValueError):
        merge_settings({}, {"global_cache_hit_threshold": 2})


def _parse(argv: list[str]) -> EngineArgs:
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    return AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", "m", *argv]))


def test_cli_flag_reaches_additional_config() -> None:
    args = _parse(["--global-cache-hit-threshold", "0.5"])
    assert args.additional_config[ADDITIONAL_CONFIG_KEY] == {
        "global_cache_hit_threshold": 0.5
    }


def test_cli_default_leaves_additional_config_alone() -> None:
    assert ADDITIONAL_CONFIG_KEY not in _parse([]).additional_config


def test_cli_flag_overrides_additional_config_entry() -> None:
    args = _parse(
        [
            "--additional-config",
            '{"kvreuse": {"global_cache_hit_threshold": 0.2}, "x": 1}',
            "--global-cache-hit-threshold",
            "0.7",
        ]
    )
    assert args.additional_config["x"] == 1
    assert (
        args.additional_config[ADDITIONAL_CONFIG_KEY]["global_cache_hit_threshold"]
        == 0.7
    )


@pytest.mark.parametrize("bad", ["1.5", "nan", "-1", "half"])
def test_bad_cli_value_is_a_usage_error(bad: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse(["--global-cache-hit-threshold", bad])
    assert exc.value.code == 2
    assert (
        "--global-cache-hit-threshold must be a number in [0, 1]"
        in capsys.readouterr().err
    )


def test_engine_args_accept_keyword_settings() -> None:
    """What LLM(..., global_cache_hit_threshold=...) passes on."""
    args = EngineArgs(model="m", global_cache_hit_threshold=0.4)
    assert args.additional_config[ADDITIONAL_CONFIG_KEY] == {
        "global_cache_hit_threshold": 0.4
    }
    with pytest.raises(ValueError, match="global_cache_hit_threshold"):
        AsyncEngineArgs(model="m", global_cache_hit_threshold=-1)


def test_chunk_cache_flag_takes_the_kv_connector_slot() -> None:

    args = _parse(["--enable-chunk-cache", "--chunk-recompute-head", "32"])
    assert args.kv_transfer_config.kv_connector == "KVReuseChunkConnector"
    assert args.additional_config[ADDITIONAL_CONFIG_KEY]["chunk_recompute_head"] == 32
    assert _parse([]).kv_transfer_config is None
    assert not _parse(
        ["--enable-chunk-cache"]
    ).kv_transfer_config.kv_connector_extra_config


def test_chunk_cache_beside_a_users_connector_builds_a_multiconnector() -> None:
    """The chunk cache first, then the user's connector with its own role and
    settings; the parent keeps the user's role and engine id."""
    from vllm.config import KVTransferConfig

    user = KVTransferConfig(
        kv_connector="ExampleConnector",
        kv_role="kv_consumer",
        kv_connector_extra_config={"shared_storage_path": "/tmp/kv"},
        kv_load_failure_policy="recompute",
    )
    multi = EngineArgs(
        model="m", enable_chunk_cache=True, kv_transfer_config=user
    ).kv_transfer_config
    assert multi.kv_connector == "MultiConnector"
    assert (multi.kv_role, multi.engine_id) == ("kv_consumer", user.engine_id)
    assert multi.kv_load_failure_policy == "recompute"
    chunk, other = multi.kv_connector_extra_config["connectors"]
    assert chunk["kv_connector"] == "KVReuseChunkConnector"
    assert chunk["kv_role"] == "kv_both"
    assert other["kv_connector"] == "ExampleConnector"
    assert other["kv_role"] == "kv_consumer"
    assert other["kv_connector_extra_config"] == {"shared_storage_path": "/tmp/kv"}
    assert "engine_id" not in other  # MultiConnector hands down the parent's
    # Folding again (a spawned API server) leaves it as it is.
    again = EngineArgs(model="m", enable_chunk_cache=True, kv_transfer_config=multi)
    assert again.kv_transfer_config.kv_connector_extra_config == (
        multi.kv_connector_extra_config
    )


def test_chunk_cache_joins_a_users_multiconnector_first() -> None:
    from vllm.config import KVTransferConfig

    children = [{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}]
    user = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": children},
    )
    multi = EngineArgs(
        model="m", enable_chunk_cache=True, kv_transfer_config=user
    ).kv_transfer_config
    names = [c["kv_connector"] for c in multi.kv_connector_extra_config["connectors"]]
    assert names == ["KVReuseChunkConnector", "ExampleConnector"]


@pytest.mark.parametrize(
    ("flag", "bad"),
    [("--chunk-attention", "mask"), ("--chunk-cache-hash", "md5"),
     ("--chunk-separator", " "), ("--chunk-cache-cpu-gib", "-1"),
     ("--chunk-paths-max-documents", "-1"), ("--chunk-paths-max-documents", "2.5")],
)  # fmt: skip
def test_bad_chunk_cache_flag_is_a_usage_error(flag: str, bad: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse([flag, bad])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def _fold_in_fresh_process(args) -> dict:
    """What a spawned API-server process does first: upstream's from_cli_args
    on the namespace it was given, before any plugin is loaded."""
    from vllm.engine.arg_utils import AsyncEngineArgs as Args

    from vllm_kvreuse.patches import is_patched

    unpatched = not is_patched(Args.from_cli_args.__func__)
    engine_args = Args.from_cli_args(args)
    return {
        "unpatched": unpatched,
        "kvreuse": engine_args.additional_config.get(ADDITIONAL_CONFIG_KEY),
        "connector": getattr(engine_args.kv_transfer_config, "kv_connector", None),
        "processors": engine_args.logits_processors,
    }


def test_settings_reach_a_spawned_api_server_process(tmp_path) -> None:
    """``--api-server-count N`` spawns API servers with the parsed namespace;
    there upstream's from_cli_args runs before plugins load (issue 22: every
    parent was refused with 400). The folded settings must ride on vLLM's own
    fields of the namespace."""
    import multiprocessing

    catalog = tmp_path / "catalog.txt"
    catalog.write_text("<a_1><b_2><c_3>\n")
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(
        ["--model", "m", "--enable-continuation", "--enable-chunk-cache",
         "--engine-beam-search", "--sid-catalog", str(catalog),
         "--logprobs-mode", "processed_logprobs",
         "--global-cache-hit-threshold", "0.5"]
    )  # fmt: skip
    AsyncEngineArgs.from_cli_args(args)  # the launcher's own call
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        seen = pool.apply(_fold_in_fresh_process, (args,))
    assert seen["unpatched"], "the child must run upstream's from_cli_args"
    assert seen["kvreuse"] == {
        "enable_continuation": True,
        "enable_chunk_cache": True,
        "engine_beam_search": True,
        "sid_catalog": str(catalog),
        "global_cache_hit_threshold": 0.5,
    }
    assert seen["connector"] == "KVReuseChunkConnector"
    assert seen["processors"] == [
        "vllm_kvreuse.beam.catalog.processor:CatalogLogitsProcessor"
    ]


def test_engine_beams_refuse_speculative_decoding(model_config) -> None:
    """A beam step runs in vLLM's sampler; a speculative step replaces it."""
    from vllm.config import SpeculativeConfig, VllmConfig

    from vllm_kvreuse.config import ADDITIONAL_CONFIG_KEY

    def config(**kwargs) -> VllmConfig:
        return VllmConfig(
            model_config=model_config,
            additional_config={ADDITIONAL_CONFIG_KEY: {"engine_beam_search": True}},
            **kwargs,
        )

    speculative = SpeculativeConfig(
        method="ngram", num_speculative_tokens=2, prompt_lookup_max=3,
        prompt_lookup_min=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match="speculative decoding"):
        config(speculative_config=speculative)
    config()


def test_settings_are_parsed_once_and_carried_by_the_config(
    model_config, monkeypatch
) -> None:
    """Parsed when the ``VllmConfig`` is built, carried by it (pickled with
    it to engine cores and workers), and read off it afterwards: a request's
    validation parses no setting."""
    import pickle

    from vllm.config import VllmConfig

    from vllm_kvreuse.core.spec import settings_of
    from vllm_kvreuse.frontend import validate_extra_args

    settings = {"enable_continuation": True, "retain_kv_ttl": 30}
    config = VllmConfig(
        model_config=model_config,
        additional_config={ADDITIONAL_CONFIG_KEY: settings},
    )
    carried = settings_of(config)
    assert carried == KVReuseConfig.from_dict(settings)
    parses: list[object] = []
    parse = KVReuseConfig.from_dict.__func__
    monkeypatch.setattr(
        KVReuseConfig, "from_dict", classmethod(lambda cls, raw: parses.append(raw))
    )
    for _ in range(3):
        assert validate_extra_args({"retain_kv": True}, config)["retain_kv"] is True
    assert settings_of(config) is carried
    assert parses == [], "a request parsed the settings again"
    monkeypatch.setattr(KVReuseConfig, "from_dict", classmethod(parse))
    assert settings_of(pickle.loads(pickle.dumps(config))) == carried
