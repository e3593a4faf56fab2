"""Adding a feature is its folder plus one line in ``SPECS``: the example
feature (``tests/example_feature/``), put in the list, reaches every shared
table, with no shared file edited for it.

The shared tables are built by functions of a spec tuple
(``config.settings_class``, ``request_args.KeyTable``,
``engine_args.add_arguments``, ``core.features.build_features`` through the
settings, ``core.spec.hooks``); the modules' own tables are those functions
applied to ``SPECS``. Here they get ``SPECS + (example,)``.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from tests.example_feature import frontend as example_frontend
from tests.example_feature.spec import SPEC as EXAMPLE
from tests.unit.conftest import make_request
from vllm_kvreuse.config import KVReuseConfig, settings_class
from vllm_kvreuse.core.context import Core
from vllm_kvreuse.core.features import build_features
from vllm_kvreuse.core.spec import hooks
from vllm_kvreuse.engine_args import add_arguments
from vllm_kvreuse.features import SPECS
from vllm_kvreuse.request_args import PUBLIC_FIELDS, BadRequestArgs, KeyTable

WITH_EXAMPLE = (*SPECS, EXAMPLE)
"""``SPECS`` with the one line added."""

ON = {"enable_request_labels": True}


def test_its_option_is_a_setting_and_a_flag() -> None:
    """The option becomes a ``KVReuseConfig`` field with its default, a
    ``vllm serve`` flag, and the switch that turns the feature on."""
    settings = settings_class(WITH_EXAMPLE)
    assert settings().enable_request_labels is False
    config = settings.from_dict(ON)
    assert config.enabled == {"core", "request_labels"}
    assert config.features == (EXAMPLE,)
    parser = argparse.ArgumentParser()
    add_arguments(parser, settings.options_by_name.values())
    assert parser.parse_args(["--enable-request-labels"]).enable_request_labels
    with pytest.raises(ValueError, match="unknown vllm-kvreuse setting"):
        KVReuseConfig.from_dict(ON)  # not in today's list


def test_its_key_is_a_request_field_checked_against_its_switch() -> None:
    """The key becomes a public body field, validated by its parser, and
    refused with the feature's flag while the feature is off."""
    table = KeyTable(WITH_EXAMPLE)
    assert "request_label" in table.public_fields
    assert "request_label" not in PUBLIC_FIELDS  # not in today's list
    table.validate({"request_label": "blue"}, frozenset({"core", "request_labels"}))
    with pytest.raises(BadRequestArgs, match="1 to 32 characters"):
        table.validate({"request_label": ""}, frozenset({"core", "request_labels"}))
    with pytest.raises(
        BadRequestArgs, match="needs a server started with --enable-request-labels"
    ):
        table.validate({"request_label": "blue"}, frozenset({"core"}))


def test_its_scheduler_feature_is_built_when_switched_on(make_scheduler) -> None:
    """The hook layer's feature builder makes the example's scheduler
    feature, which sees the key on the requests it is handed."""
    core = Core(make_scheduler(), settings_class(WITH_EXAMPLE).from_dict(ON))
    [feature] = build_features(core)
    assert feature.name == "request_labels"
    feature.on_add(make_request("a", range(8), request_label="blue"))
    feature.on_add(make_request("b", range(8)))
    assert feature.live_labels == {"blue": 1}


def test_its_frontend_hook_counts_in_metrics() -> None:
    """Its ``on_final_output`` is called after the other features' (list
    order) and counts in the plugin's ``/metrics`` namespace."""
    assert hooks(WITH_EXAMPLE, "on_final_output")[-1] is (
        example_frontend.on_final_output
    )
    name, labels = "vllm_kvreuse:example_final_outputs_total", {"finish_reason": "stop"}
    before = REGISTRY.get_sample_value(name, labels) or 0.0
    example_frontend.on_final_output(None, SimpleNamespace(finish_reason="stop"), 0, 0)
    assert REGISTRY.get_sample_value(name, labels) == before + 1
