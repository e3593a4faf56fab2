"""pytest plugin for ``scripts/upstream_suite.sh``: puts the test process in one mode.

Loaded with ``-p kvreuse_upstream_mode`` into vLLM's own test suite; test
tooling only, never part of the plugin. ``KVREUSE_UPSTREAM_MODE`` picks:

- ``off``: the entry point reaches a stub ``vllm_kvreuse`` whose
  ``register()`` does nothing (the runner puts it first on PYTHONPATH).
  Checked at the end of the session: the stub is what was imported, and no
  target of the real patch registry carries a patch marker.
- ``flags-off``: the plugin loads as in any vLLM process, every setting at its
  default. Checked: every patch in the registry is applied.
- ``features-on``: as ``flags-off``, and (1) every ``VllmConfig`` built in this
  process carries ``additional_config["kvreuse"] = FEATURES`` unless the test
  set its own, and (2) the upstream test modules' module-level names bound to
  vLLM's ``Scheduler``/``AsyncScheduler`` (which the tests instantiate
  directly, bypassing ``get_scheduler_cls``) are rebound to the plugin's
  composed scheduler class, so the tests drive the plugin's mixins.

``load_general_plugins()`` runs in ``pytest_configure`` in every mode, as it
does early in every vLLM process, so whether the plugin is active does not
depend on which test first builds an ``EngineArgs``.

``KVREUSE_UPSTREAM_REPORT`` names a JSON file that receives what was checked;
the runner refuses a run whose report does not match its mode.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

MODES = ("off", "flags-off", "features-on")
MODE = os.environ.get("KVREUSE_UPSTREAM_MODE", "")

# Chunk cache stays off: it takes the KV-connector slot that many of these
# tests fill with their own connector.
FEATURES: dict[str, Any] = {
    "engine_beam_search": True,
    "global_cache_hit_threshold": 0.0,
    "enable_continuation": True,
}

_report: dict[str, Any] = {"mode": MODE}
if MODE == "features-on":
    _report["features"] = FEATURES
_injected = [0]


def _kvreuse_modules() -> list[str]:
    return sorted(
        name
        for name in sys.modules
        if name == "vllm_kvreuse" or name.startswith("vllm_kvreuse.")
    )


MARKER = "__kvreuse_patch__"
"""``vllm_kvreuse.patches.registry.MARKER``: what a patched function carries."""


def _targets() -> list[str]:
    """The patch registry's targets, listed by the runner from the checkout
    (in ``off`` mode the plugin package itself is the stub)."""
    return json.loads(Path(os.environ["KVREUSE_UPSTREAM_TARGETS"]).read_text())


def _owner_and_attr(target: str) -> tuple[Any, str]:
    import importlib

    module_name, qualname = target.split(":")
    *path, attr = qualname.split(".")
    owner: Any = importlib.import_module(module_name)
    for name in path:
        owner = getattr(owner, name)
    return owner, attr


def _patch_state() -> tuple[list[str], list[str]]:
    """(applied, missing) patch targets of the plugin's registry."""
    applied, missing = [], []
    for target in _targets():
        owner, attr = _owner_and_attr(target)
        current = inspect.getattr_static(owner, attr, None)
        raw = getattr(current, "__func__", current)
        # features-on wraps VllmConfig.__post_init__ again: look underneath.
        while raw is not None and not getattr(raw, MARKER, None):
            raw = getattr(raw, "__wrapped__", None)
        (applied if raw is not None else missing).append(target)
    return applied, missing


def _inject_features() -> None:
    from vllm.config import VllmConfig

    original = VllmConfig.__post_init__

    def __post_init__(self: Any) -> None:
        extra = self.additional_config
        if isinstance(extra, dict) and "kvreuse" not in extra:
            self.additional_config = {**extra, "kvreuse": dict(FEATURES)}
            _injected[0] += 1
        original(self)

    __post_init__.__wrapped__ = original  # type: ignore[attr-defined]
    VllmConfig.__post_init__ = __post_init__


def _composed(base: type) -> type:
    """The class the plugin's get_scheduler_cls returns for ``base``."""
    from vllm_kvreuse.scheduler import scheduler_class

    return scheduler_class(base)


def pytest_configure(config: pytest.Config) -> None:
    if MODE not in MODES:
        raise pytest.UsageError(
            f"KVREUSE_UPSTREAM_MODE must be one of {MODES}, got {MODE!r}"
        )
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    import vllm_kvreuse

    _report["plugin_path"] = str(Path(vllm_kvreuse.__file__).parent)
    _report["stub"] = bool(getattr(vllm_kvreuse, "UPSTREAM_SUITE_STUB", False))
    if MODE == "off":
        return
    applied, missing = _patch_state()
    _report["patches_applied"] = len(applied)
    _report["patches_missing"] = missing
    if MODE == "features-on":
        _inject_features()


def pytest_report_header(config: pytest.Config) -> list[str]:
    where = _report.get("plugin_path", "not loaded")
    return [f"vllm-kvreuse upstream mode: {MODE} (plugin: {where})"]


def pytest_collection_finish(session: pytest.Session) -> None:
    if MODE != "features-on":
        return
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    tests_dir = Path(str(session.config.rootpath)) / "tests"
    bases = {id(Scheduler): Scheduler, id(AsyncScheduler): AsyncScheduler}
    rebound: list[str] = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not path or not Path(path).is_relative_to(tests_dir):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and id(value) in bases:
                setattr(module, attr, _composed(value))
                rebound.append(f"{name}.{attr}")
    _report["rebound_scheduler_names"] = sorted(rebound)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if MODE == "off":
        _report["modules_at_end"] = _kvreuse_modules()
        applied, _ = _patch_state()
        _report["patches_applied"] = len(applied)
        _report["patched_targets"] = applied
    else:
        _report["patches_missing_at_end"] = _patch_state()[1]
    _report["configs_injected"] = _injected[0]
    path = os.environ.get("KVREUSE_UPSTREAM_REPORT")
    if path:
        Path(path).write_text(json.dumps(_report, indent=2) + "\n")
