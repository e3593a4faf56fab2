"""The scheduler hook layer: composition, one override per upstream method,
features that never know each other, and failures contained to one request."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.diffusion_scheduler import DiffusionScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

import vllm_kvreuse
from tests.unit.conftest import make_request, run_to_completion
from vllm_kvreuse.compat import supported_release
from vllm_kvreuse.core.feature import HOOKS, Feature
from vllm_kvreuse.core.features import feature_class
from vllm_kvreuse.core.layer import KVReuseLayer
from vllm_kvreuse.features import SPECS
from vllm_kvreuse.patches import SCHEDULER_OVERRIDES, signature_of
from vllm_kvreuse.scheduler import scheduler_class

PACKAGE = Path(vllm_kvreuse.__file__).parent
FEATURE_PACKAGES = ("admission", "beam", "chunk_cache", "continuation")
FEATURE_ORDER = [feature_class(spec) for spec in SPECS]


def test_a_feature_puts_the_layer_in_front_of_vllms_choice(make_scheduler) -> None:
    scheduler = make_scheduler()
    names = [cls.__name__ for cls in type(scheduler).__mro__][:3]
    assert names == ["KVReuseScheduler", "KVReuseLayer", "Scheduler"]


def test_no_feature_leaves_vllms_class_untouched(make_scheduler) -> None:
    scheduler = make_scheduler(plugin=False)
    assert type(scheduler) is Scheduler
    assert not hasattr(scheduler, "kvreuse")


@pytest.mark.parametrize("base", [Scheduler, AsyncScheduler, DiffusionScheduler])
def test_compose_keeps_the_base_and_is_cached(base: type) -> None:
    composed = scheduler_class(base)
    assert composed.__mro__[1:3] == (KVReuseLayer, base)
    assert scheduler_class(base) is composed
    assert scheduler_class(composed) is composed


def test_each_upstream_method_is_overridden_once_with_a_pinned_signature() -> None:
    overridden = {
        name
        for name, value in vars(KVReuseLayer).items()
        if callable(value) and hasattr(Scheduler, name)
    }
    assert overridden == set(SCHEDULER_OVERRIDES), "update SCHEDULER_OVERRIDES"
    release = supported_release()
    changed = {
        name: signature_of(getattr(Scheduler, name))
        for name, pinned in SCHEDULER_OVERRIDES.items()
        if signature_of(getattr(Scheduler, name)) != pinned[release]
    }
    assert changed == {}, "upstream changed a method the hook layer overrides"


def test_features_are_plain_objects_with_known_hooks() -> None:
    for feature in FEATURE_ORDER:
        assert not issubclass(feature, Scheduler), feature
        assert issubclass(feature, Feature) and feature.name
        unknown = {
            name
            for name, value in vars(feature).items()
            if callable(value) and not name.startswith("_") and hasattr(Feature, name)
        } - set(HOOKS)
        assert unknown == set(), f"{feature.__name__} overrides non-hooks {unknown}"


def test_exclusive_hooks_have_at_most_one_implementer() -> None:
    """Two features answering the same exclusive hook would conflict."""
    for hook, kind in HOOKS.items():
        implementers = [
            f.__name__
            for f in FEATURE_ORDER
            if getattr(f, hook) is not getattr(Feature, hook)
        ]
        if kind == "exclusive":
            assert len(implementers) <= 1, f"{hook}: {implementers}"


def _imports_of(path: Path, forbidden: set[str]) -> list[str]:
    """The modules ``path`` imports that are, or are inside, ``forbidden``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        found += [
            name
            for name in names
            if any(name == o or name.startswith(o + ".") for o in forbidden)
        ]
    return found


def test_features_never_import_each_other() -> None:
    offenders = []
    for package in FEATURE_PACKAGES:
        others = {f"vllm_kvreuse.{p}" for p in FEATURE_PACKAGES} - {
            f"vllm_kvreuse.{package}"
        }
        for path in (PACKAGE / package).rglob("*.py"):
            offenders += [
                f"{package}/{path.name} imports {name}"
                for name in _imports_of(path, others)
            ]
    assert offenders == []


def test_core_imports_nothing_above_it() -> None:
    """Keys and services features share live in core; only the top floor's
    list (``vllm_kvreuse/features.py``) names the features. Core imports no
    feature and nothing of the top floor either (the settings table, the
    list, the request keys' table): the layer is given how to read the
    settings (``vllm_kvreuse/scheduler.py``), and core reads keys from
    ``core.request_keys``."""
    above = {
        f"vllm_kvreuse.{path.stem}"
        for path in PACKAGE.iterdir()
        if path.name != "core" and (path.suffix == ".py" or path.is_dir())
    } - {"vllm_kvreuse.__init__", "vllm_kvreuse.__pycache__"}
    assert {"vllm_kvreuse.config", "vllm_kvreuse.beam"} <= above
    offenders = [
        f"core/{path.name} imports {name}"
        for path in (PACKAGE / "core").rglob("*.py")
        for name in _imports_of(path, above)
    ]
    assert offenders == [], "core takes what it needs from above as a parameter"


SHARED_TABLES = (
    "config.py",
    "request_args.py",
    "engine_args.py",
    "metrics.py",
    "frontend.py",
    "core/features.py",
)


def test_shared_tables_loop_over_the_specs() -> None:
    """The shared tables import no feature folder: each feature's options,
    request keys, engine hooks and counters come from its own folder, through
    the one list (``vllm_kvreuse/features.py``), and so do the frontend
    wrappers' hooks."""
    forbidden = {f"vllm_kvreuse.{p}" for p in FEATURE_PACKAGES}
    offenders = [
        f"{name} imports {module}"
        for name in SHARED_TABLES
        for module in _imports_of(PACKAGE / name, forbidden)
    ]
    assert offenders == [], "declare it in the feature's spec instead"


def test_a_feature_failing_on_one_request_fails_that_request_alone(
    make_scheduler,
) -> None:
    """A request whose plugin data breaks a hook ends with ERROR; the other
    request runs to the end and nothing leaks (checked by the fixture)."""
    scheduler = make_scheduler()
    bad = make_request("bad", list(range(40)), kvreuse_beam={"width": "x"})
    good = make_request("good", list(range(100, 140)))
    scheduler.add_request(bad)
    scheduler.add_request(good)
    outputs = run_to_completion(scheduler)
    finals = {o.request_id: o for o in outputs if o.finish_reason is not None}
    assert finals["bad"].finish_reason == FinishReason.ERROR
    assert finals["good"].finish_reason == FinishReason.LENGTH
    assert bad.status == RequestStatus.FINISHED_ERROR
    assert not scheduler.requests


def test_hook_names_match_feature_methods() -> None:
    assert set(HOOKS) <= {
        name for name, _ in inspect.getmembers(Feature, inspect.isfunction)
    }


def test_an_internal_request_runs_for_its_clients_request() -> None:
    """Beam members and answer paths' scoring requests are derived from a
    client's request by one helper: its client index, LoRA adapter, cache
    salt and priority, so the KV they compute and cache is the client's."""
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams

    from vllm_kvreuse.core.internal import derived_request

    client = make_request("client", list(range(40)), cache_salt="tenant")
    client.client_index, client.priority = 3, -2
    client.lora_request = LoRARequest("adapter", 1, "/adapters/one")
    params = SamplingParams(max_tokens=1)
    internal = derived_request(client, "internal", [1, 2, 3], params)
    assert (internal.request_id, internal.prompt_token_ids) == ("internal", [1, 2, 3])
    assert internal.sampling_params is params
    assert (internal.client_index, internal.priority) == (3, -2)
    assert (internal.lora_request, internal.cache_salt) == (
        client.lora_request,
        "tenant",
    )
    assert internal.block_hashes == []
