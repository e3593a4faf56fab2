"""The one seam to vLLM's internal state: every attribute it touches is
registered and exists on the installed vLLM's real objects with its pinned
signature (tests/unit/test_private_access.py: and nothing else touches it)."""

from __future__ import annotations

import argparse
import ast
import importlib
from pathlib import Path
from typing import Any

import pytest
from vllm.config import ModelConfig

import vllm_kvreuse
from tests.unit.conftest import make_request
from tests.unit.scheduler_driver import make_full_scheduler
from vllm_kvreuse.compat import SUPPORTED_VLLM, supported_release
from vllm_kvreuse.patches import UPSTREAM_STATE, UpstreamState, signature_of
from vllm_kvreuse.patches.runner_state import HOOKS as HOOKS_MODULE
from vllm_kvreuse.patches.runner_state import RUNNER_STATE
from vllm_kvreuse.patches.upstream_state import ATTRIBUTE

PACKAGE = Path(vllm_kvreuse.__file__).parent
HOOKS = PACKAGE.parent / Path(*HOOKS_MODULE.split(".")).with_suffix(".py")
"""The runner side's one module that reads runner state (RUNNER_STATE)."""


def _owner_class(entry: UpstreamState) -> Any:
    """The entry's owner class, or its module for a module's function."""
    module, _, qualname = entry.owner.partition(":")
    owner: Any = importlib.import_module(module)
    return getattr(owner, qualname) if qualname else owner


@pytest.fixture(scope="module")
def real_objects(model_config: ModelConfig) -> list[Any]:
    """The upstream objects of a real scheduler (every feature on) after one
    step: instance attributes exist only on these."""
    scheduler = make_full_scheduler(model_config)
    request = make_request("r", list(range(40)))
    scheduler.add_request(request)
    output = scheduler.schedule()
    manager = scheduler.kv_cache_manager
    return [
        argparse.ArgumentParser(),
        scheduler,
        scheduler.waiting,
        manager,
        manager.coordinator,
        manager.coordinator.single_type_managers[0],
        manager.block_pool,
        manager.block_pool.blocks[1],
        request,
        request.sampling_params,
        scheduler.vllm_config.parallel_config,
        output.scheduled_cached_reqs,
        output.scheduled_new_reqs[0],
    ]


@pytest.mark.parametrize("entry", UPSTREAM_STATE, ids=lambda e: e.target)
def test_each_attribute_exists_on_the_installed_vllm(
    entry: UpstreamState, real_objects: list[Any]
) -> None:
    assert set(entry.releases) == set(SUPPORTED_VLLM), "pin every release"
    owner = _owner_class(entry)
    pinned = entry.releases[supported_release()]
    if pinned != ATTRIBUTE:
        assert signature_of(getattr(owner, entry.name, None)) == pinned, (
            f"upstream changed {entry.target}, which {entry.seam} calls"
        )
        return
    instances = [obj for obj in real_objects if isinstance(obj, owner)]
    assert instances, f"no real {owner.__name__} to check {entry.name} on"
    assert all(hasattr(obj, entry.name) for obj in instances), (
        f"{entry.target} is gone: {entry.seam} uses it"
    )


OWN_NAMES = {
    "finish", "prepare", "results", "holds_every_row", "reads_draws",
    "get", "pop", "setdefault", "num_blocks", "int32", "new_zeros",
}  # fmt: skip
"""Names ``runner_hooks`` reads off its own objects (the beam job, dicts),
off torch (a dtype, a tensor method) or off public config
(``KVCacheConfig.num_blocks``)."""


def test_runner_hooks_read_only_registered_runner_state() -> None:
    """Every runner attribute the sampler patches read is in RUNNER_STATE
    (checked per release on live workers, tests/integration/test_runner_tier.py),
    and every entry is still read."""
    tree = ast.parse(HOOKS.read_text())
    read = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    read |= _strings(HOOKS) & {"model_runner_output", "_model_runner_output"}
    registered = {entry.name for entry in RUNNER_STATE}
    assert sorted(read - registered - OWN_NAMES) == [], "register in RUNNER_STATE"
    assert sorted(registered - read) == [], "drop these from RUNNER_STATE"


def _attribute_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and not (isinstance(node.value, ast.Name) and node.value.id == "self")
    }


def _strings(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
