"""The threshold rule on its own: precedence and boundaries."""

from __future__ import annotations

import pytest

from vllm_kvreuse.admission.policy import decide, effective_threshold, parse_threshold


@pytest.mark.parametrize(
    ("extra_args", "global_value", "expected"),
    [
        (None, 0.3, 0.3),
        ({}, 0.3, 0.3),
        ({"cache_hit_threshold": None}, 0.3, 0.3),
        ({"cache_hit_threshold": 0.0}, 0.9, 0.0),
        ({"cache_hit_threshold": 0.8}, 0.1, 0.8),
    ],
)
def test_request_value_overrides_global(extra_args, global_value, expected) -> None:
    assert effective_threshold(extra_args, global_value) == expected


@pytest.mark.parametrize(
    ("hits", "tokens", "threshold", "admit"),
    [
        (0, 100, 0.0, True),
        (0, 100, 0.01, False),
        (50, 100, 0.5, True),
        (49, 100, 0.5, False),
        (99, 100, 1.0, False),
        (100, 100, 1.0, True),
    ],
)
def test_admit_iff_hit_rate_reaches_threshold(hits, tokens, threshold, admit) -> None:
    decision = decide(hits, tokens, threshold)
    assert decision.admit is admit
    assert decision.hit_rate == hits / tokens


def test_hits_beyond_the_request_are_a_bug() -> None:
    with pytest.raises(AssertionError, match="hit source"):
        decide(11, 10, 0.5)


def test_parse_threshold_names_the_field() -> None:
    with pytest.raises(ValueError, match="cache_hit_threshold"):
        parse_threshold("x")
