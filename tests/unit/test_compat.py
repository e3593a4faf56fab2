"""The plugin loads next to a supported vLLM release only."""

from __future__ import annotations

import pytest

from vllm_kvreuse.compat import (
    PINNED_VLLM_VERSION,
    SUPPORTED_VLLM,
    IncompatibleVLLMError,
    check_vllm_version,
    supported_release,
)


@pytest.mark.parametrize(
    ("version", "release"),
    [
        ("0.32.0", "0.32.0"),
        ("0.32.0+cpu", "0.32.0"),
        ("0.32.0+cu130", "0.32.0"),
        ("0.32.0.post1", "0.32.0"),
    ],
)
def test_supported_release_and_its_builds_load(version: str, release: str) -> None:
    check_vllm_version(version)
    assert supported_release(version) == release


@pytest.mark.parametrize("version", ["0.31.2", "0.32.1", "0.33.0", "0.32.0rc1"])
def test_other_releases_are_refused_with_a_clear_message(version: str) -> None:
    with pytest.raises(IncompatibleVLLMError, match=f"vLLM {version} is installed"):
        check_vllm_version(version)


def test_installed_vllm_is_the_pinned_one() -> None:
    assert supported_release() == PINNED_VLLM_VERSION


def test_each_row_is_keyed_by_its_own_release() -> None:
    """supported_release() returns a key; patches look signatures up by it."""
    assert all(key == row.release for key, row in SUPPORTED_VLLM.items())
