"""The patch registry: applied, idempotent, complete, and upstream unchanged."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_kvreuse
from vllm_kvreuse.compat import SUPPORTED_VLLM, supported_release
from vllm_kvreuse.patches import (
    PATCHES,
    apply_all,
    apply_for_runner,
    is_patched,
    signature_of,
)

PACKAGE = Path(vllm_kvreuse.__file__).parent


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.target)
def test_patched_upstream_symbol_has_expected_signature(patch) -> None:
    """Fails when vLLM changes a symbol we wrap: re-check the wrapper then."""
    release = supported_release()
    assert signature_of(patch.original()) == patch.signatures[release], (
        f"{patch.target} differs from its vLLM {release} signature; review "
        f"{patch.wrapper} and update the registry entry"
    )


def test_every_patch_records_every_supported_release() -> None:
    """A release added to compat.SUPPORTED_VLLM needs each target's signature."""
    missing = [
        (patch.target, release)
        for patch in PATCHES
        for release in SUPPORTED_VLLM
        if release not in patch.signatures
    ]
    unknown = [
        (patch.target, release)
        for patch in PATCHES
        for release in patch.signatures
        if release not in SUPPORTED_VLLM
    ]
    assert missing == [] and unknown == []


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.target)
def test_every_registered_patch_is_applied(patch) -> None:
    if patch.runner is not None:  # as a worker that builds this runner does
        apply_for_runner(patch.runner)
    owner, attr = patch.owner_and_attr()
    current = inspect.getattr_static(owner, attr)
    raw = getattr(current, "__func__", current)
    assert is_patched(raw), f"{patch.target} is registered but not applied"
    if patch.kind == "subclass":
        assert raw.__bases__ == (patch.original(),)
    elif patch.kind != "new":
        assert raw.__wrapped__ is patch.original()


def test_apply_all_is_idempotent() -> None:
    vllm_kvreuse.register()
    assert apply_all() == []
    vllm_kvreuse.register()
    assert apply_all() == []


def test_runner_patches_wait_for_a_worker_of_their_runner() -> None:
    """Loading the plugin leaves every runner's code alone; a worker applies
    its own runner's patches (tests/integration/test_runner_tier.py checks
    that in live engines of each tier)."""
    code = (
        "import vllm_kvreuse, inspect\n"
        "from vllm_kvreuse.patches import PATCHES, is_patched\n"
        "vllm_kvreuse.register()\n"
        "def on(p):\n"
        "    owner, attr = p.owner_and_attr()\n"
        "    raw = inspect.getattr_static(owner, attr)\n"
        "    return is_patched(getattr(raw, '__func__', raw))\n"
        "print(sorted(p.target for p in PATCHES if p.runner and on(p)))\n"
        "print(all(on(p) for p in PATCHES if p.runner is None))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[-2:] == ["[]", "True"]
    assert any(patch.runner for patch in PATCHES)


def test_every_patch_entry_is_documented() -> None:
    for patch in PATCHES:
        assert patch.why and patch.how and patch.remove_when, patch.target


def test_no_module_patches_vllm_outside_the_registry() -> None:
    """Only the patches package may assign attributes on imported objects."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "patches":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr":
                offenders.append(f"{path.name}:{node.lineno} setattr")
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id[:1].isupper()
                ):
                    offenders.append(f"{path.name}:{node.lineno} {target.value.id}.")
    assert offenders == []


def test_wrapped_targets_are_unique() -> None:
    targets = [patch.target for patch in PATCHES]
    assert len(targets) == len(set(targets))
