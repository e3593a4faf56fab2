"""The request-label feature's declaration: one setting, one key, its hooks."""

from __future__ import annotations

from typing import Any

from vllm_kvreuse.core.options import Option, parse_bool
from vllm_kvreuse.core.spec import ArgKey, FeatureSpec

REQUEST_LABEL = "request_label"


def parse_label(value: Any) -> str:
    """A label: a non-empty string of at most 32 characters."""
    if not isinstance(value, str) or not 0 < len(value) <= 32:
        raise ValueError(f"{REQUEST_LABEL} must be a string of 1 to 32 characters")
    return value


SPEC = FeatureSpec(
    name="request_labels",
    options=(
        Option(
            "enable_request_labels",
            parse_bool,
            False,
            "Accept a 'request_label' on each request and tally the labels of "
            "live requests.",
        ),
    ),
    keys=(
        ArgKey(
            REQUEST_LABEL,
            "request_labels",
            True,
            parse_label,
            "A label the client gives the request.",
        ),
    ),
    switch="enable_request_labels",
    feature="tests.example_feature.feature:RequestLabels",
    on_final_output="tests.example_feature.frontend:on_final_output",
)
