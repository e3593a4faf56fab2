"""No private upstream attribute is touched without a registry entry, and
none outside its entry's seam (docs/architecture.md, "Patch registry").

The scan (:mod:`tests.unit.private_access`) reads every module of the
package and finds each attribute access and whose attribute it is. A
private name the package does not own is upstream's: it must be registered
(``UPSTREAM_STATE``, ``RUNNER_STATE``, or a method the hook layer
overrides, ``SCHEDULER_OVERRIDES``) and touched only in the module its
entry names (a module of ``core/upstream/``, one a side, unless the entry
names a registered patch's own module). Public upstream state the seam
owns is guarded too: the scheduler's and KV manager's, anywhere; a
request's fields the seam rewrites, when written or called.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from tests.unit.private_access import Access, accesses, is_private, owned_by_package
from vllm_kvreuse.patches import SCHEDULER_OVERRIDES, UPSTREAM_STATE
from vllm_kvreuse.patches.runner_state import HOOKS, RUNNER_STATE
from vllm_kvreuse.patches.upstream_state import REQUEST_SEAM, SEAM

LAYER = "vllm_kvreuse.core.layer"
"""The hook layer: the one module that overrides upstream methods."""

SCHEDULER_SIDE = (
    "Scheduler",
    "KVCacheManager",
    "KVCacheCoordinator",
    "SingleTypeKVCacheManager",
    "BlockPool",
    "RequestQueue",
)
"""Owners whose registered state is guarded however it is used."""
READ_EVERYWHERE = {"requests", "use_v2_model_runner", "num_gpu_blocks"}
"""Reads, not state: features look requests up by id; the other two are
also public fields of vLLM's configs (``VllmConfig``, ``CacheConfig``)."""


def _seams() -> dict[str, set[str]]:
    """Each registered name and the modules that may touch it."""
    seams: dict[str, set[str]] = defaultdict(set)
    for entry in (*UPSTREAM_STATE, *RUNNER_STATE):
        seams[entry.name].add(entry.seam)
    for name in SCHEDULER_OVERRIDES:
        seams[name].add(LAYER)
    return seams


SEAMS = _seams()
PUBLIC = {e.name for e in UPSTREAM_STATE if not e.name.startswith("_")}
GUARDED_ANY_USE = {
    e.name for e in UPSTREAM_STATE if e.owner.endswith(SCHEDULER_SIDE)
} & (PUBLIC - READ_EVERYWHERE)
GUARDED_CHANGES = PUBLIC - GUARDED_ANY_USE - READ_EVERYWHERE


@pytest.fixture(scope="module")
def found() -> list[Access]:
    return list(accesses())


def _guarded(access: Access) -> bool:
    """Whether ``access`` touches upstream state only a seam may touch."""
    name = access.name
    if is_private(name):
        return name in SEAMS or not owned_by_package(access)
    if name in GUARDED_ANY_USE:
        return not owned_by_package(access)
    changes = access.store or access.call
    return changes and name in GUARDED_CHANGES and not owned_by_package(access)


def test_no_unregistered_private_access(found: list[Access]) -> None:
    """A private attribute the package does not define is upstream's: it
    needs an entry (owner, why, a pin per release) and a seam."""
    unregistered = [
        a.where()
        for a in found
        if is_private(a.name) and a.name not in SEAMS and not owned_by_package(a)
    ]
    assert not unregistered, (
        "register these in patches/upstream_state.py and reach them through "
        "core/upstream/ (or the registered patch's own module), or use a "
        "public upstream method:\n" + "\n".join(unregistered)
    )


def test_registered_state_only_in_its_seam(found: list[Access]) -> None:
    outside = [
        f"{a.where()} (seam: {', '.join(sorted(SEAMS.get(a.name, {SEAM})))})"
        for a in found
        if _guarded(a) and a.module not in SEAMS.get(a.name, {SEAM})
    ]
    assert not outside, "go through the entry's seam:\n" + "\n".join(outside)


def test_every_entry_is_touched_by_its_seam(found: list[Access]) -> None:
    """The registries list what the seams touch, nothing they no longer do."""
    touched = {(a.module, a.name) for a in found}
    stale = [
        e.target
        for e in (*UPSTREAM_STATE, *RUNNER_STATE)
        if e.name != "__init__" and (e.seam, e.name) not in touched
    ]
    assert not stale, "drop these entries (or fix their seam):\n" + "\n".join(stale)


def test_the_scan_sees_what_it_must() -> None:
    """The scan's own check: it finds the seam's private reads, names given
    to ``getattr`` by a constant, and an override's ``super()`` call."""
    seen = {(a.module, a.name, a.receiver) for a in accesses()}
    assert (REQUEST_SEAM, "_all_token_ids", "other") in seen
    assert (LAYER, "_free_request", "super") in seen
    assert (HOOKS, "_model_runner_output", "other") in seen
