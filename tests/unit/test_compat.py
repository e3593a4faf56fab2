"""The plugin refuses to load next to any vLLM but 0.32.0."""

from __future__ import annotations

import pytest

from vllm_kvreuse.compat import IncompatibleVLLMError, check_vllm_version


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.0+cu130"])
def test_pinned_release_and_its_local_builds_load(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.32.1", "0.33.0", "0.32.0rc1"])
def test_other_releases_are_refused_with_a_clear_message(version: str) -> None:
    with pytest.raises(IncompatibleVLLMError, match=f"vLLM {version} is installed"):
        check_vllm_version(version)


def test_installed_vllm_is_the_pinned_one() -> None:
    check_vllm_version()
