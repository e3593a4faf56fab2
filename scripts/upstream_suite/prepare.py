"""Prepares the upstream suite's environment: vLLM's sdist tests, the
test-only packages the plugin's venv lacks, and the plugin folders put on
``PYTHONPATH`` (a link to this checkout's package, or a no-op stub).

Used by ``run.py``; every step is cached in the cache folder and skipped
when already done.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Imported by tests/conftest.py or by test modules of DEFAULT_PATHS, missing
# from the plugin's venv: (distribution, module). Versions come from the
# sdist's requirements/test/cpu.txt.
TEST_PACKAGES = (
    ("tblib", "tblib"),
    ("pytest-asyncio", "pytest_asyncio"),
    ("pytest-mock", "pytest_mock"),
    ("msgpack", "msgpack"),  # moriio connector tests
    ("ray", "ray"),  # nixl connector tests
)


def log(msg: str) -> None:
    print(f"[upstream] {msg}", flush=True)


def vllm_version() -> str:
    import vllm

    return vllm.__version__.split("+")[0]


def fetch_sdist(cache: Path, version: str) -> Path:
    sdist_dir = cache / "sdist"
    tarball = sdist_dir / f"vllm-{version}.tar.gz"
    if tarball.exists():
        return tarball
    sdist_dir.mkdir(parents=True, exist_ok=True)
    log(f"downloading the vllm=={version} sdist into {sdist_dir}")
    # pip prepares the sdist's metadata before saving it. The "empty" target
    # device builds no extension and, without a version suffix, the metadata
    # version matches the requested one (else pip discards "0.32.0+cpu").
    env = dict(os.environ, VLLM_TARGET_DEVICE="empty", VLLM_SKIP_VERSION_SUFFIX="1")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        f"vllm=={version}",
        "--no-deps",
        "--no-binary",
        "vllm",
        "--dest",
        str(sdist_dir),
    ]
    subprocess.run(cmd, env=env, check=True)
    if not tarball.exists():
        sys.exit(f"pip download did not leave {tarball}")
    return tarball


def extract(tarball: Path, cache: Path, version: str) -> Path:
    root = cache / f"vllm-{version}"
    stamp = root / ".extracted"
    if stamp.exists():
        return root
    if root.exists():
        shutil.rmtree(root)
    prefix = f"vllm-{version}/"
    wanted = ("tests/", "pyproject.toml", "requirements/test/cpu.txt")
    log(f"extracting tests/ from {tarball.name} into {root}")
    with tarfile.open(tarball) as tar:
        members = []
        for member in tar.getmembers():
            rel = member.name[len(prefix) :] if member.name.startswith(prefix) else ""
            if rel and rel.startswith(wanted) and (member.isfile() or member.isdir()):
                member.name = rel
                members.append(member)
        root.mkdir(parents=True)
        try:
            tar.extractall(root, members=members, filter="data")
        except TypeError:  # Python without extraction filters (< 3.10.12)
            tar.extractall(root, members=members)
    stamp.write_text(version + "\n")
    return root


def pins(root: Path) -> dict[str, str]:
    found = {}
    for line in (root / "requirements/test/cpu.txt").read_text().splitlines():
        if "==" in line and not line.startswith((" ", "#")):
            name, version = line.split("==", 1)
            found[name.strip().lower()] = version.strip()
    return found


def install_test_packages(root: Path, site: Path) -> None:
    import importlib.util

    sys.path.insert(0, str(site))
    try:
        missing = [d for d, m in TEST_PACKAGES if importlib.util.find_spec(m) is None]
    finally:
        sys.path.remove(str(site))
    if not missing:
        return
    versions = pins(root)
    specs = [f"{d}=={versions[d]}" if d in versions else d for d in missing]
    log(f"installing test-only packages into {site}: {' '.join(specs)}")
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
    subprocess.run([*cmd, "--target", str(site), *specs], check=True)


def plugin_link(cache: Path) -> Path:
    """A folder holding only ``vllm_kvreuse`` (a link to this checkout's).

    Putting the repository root on PYTHONPATH would also expose its own
    ``tests`` package, which would shadow vLLM's ``tests`` in subprocesses.
    """
    pkg = cache / "pkg"
    pkg.mkdir(parents=True, exist_ok=True)
    link = pkg / "vllm_kvreuse"
    target = REPO / "vllm_kvreuse"
    if link.is_symlink() and link.resolve() == target:
        return pkg
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target, target_is_directory=True)
    return pkg


def plugin_stub(cache: Path) -> Path:
    """A folder holding a ``vllm_kvreuse`` whose ``register()`` does nothing.

    The ``off`` mode puts it first on PYTHONPATH: vLLM still finds the entry
    point and calls it (in the test process and in every subprocess) but
    nothing is patched. ``VLLM_PLUGINS`` would not do: it is an allowlist, and
    a test that loads a fake plugin through ``load_general_plugins()``
    (``test_scheduler_kv_connector_override.py``) fails under it.
    """
    stub = cache / "stub" / "vllm_kvreuse"
    stub.mkdir(parents=True, exist_ok=True)
    (stub / "__init__.py").write_text(
        '"""Stand-in for vllm-kvreuse in the upstream suite\'s off mode."""\n\n'
        "UPSTREAM_SUITE_STUB = True\n\n\n"
        "def register() -> None:\n"
        "    pass\n"
    )
    return stub.parent
