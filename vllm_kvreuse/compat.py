"""The vLLM releases this plugin supports, and the check on load.

Support is a table, one row per vLLM release. Adding a release is data: a
row here and, for every entry in :mod:`vllm_kvreuse.patches`, the
signature its target has in that release (``tests/unit/test_patches.py``
refuses a row without them). Whether the plugin's behaviour holds on a
release is another matter, shown only by running the test suite there.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import Version


@dataclass(frozen=True, slots=True)
class SupportedVLLM:
    """One vLLM release the plugin is built against.

    ``vllm_ascend`` names the vllm-ascend release built for this vLLM, or is
    None where vllm-ascend has published none (then the Ascend port cannot
    be installed against this release; see docs/ascend.md).
    """

    release: str
    vllm_ascend: str | None


SUPPORTED_VLLM: dict[str, SupportedVLLM] = {
    "0.32.0": SupportedVLLM(release="0.32.0", vllm_ascend=None),
}
"""Supported vLLM releases, keyed by release ("0.32.0")."""

PINNED_VLLM_VERSION = "0.32.0"
"""The release the extras in pyproject.toml install and CI tests."""

assert PINNED_VLLM_VERSION in SUPPORTED_VLLM, "the pinned release must be supported"


class IncompatibleVLLMError(RuntimeError):
    """Raised on load when the installed vLLM is not a supported release."""


def supported_release(installed: str | None = None) -> str:
    """The key in :data:`SUPPORTED_VLLM` that ``installed`` (default: the
    installed vLLM) is a build of, or :class:`IncompatibleVLLMError`.

    Local builds (``0.32.0+cpu``) and post releases of a supported release
    are accepted; other releases and pre-releases are not.
    """
    if installed is None:
        import vllm

        installed = vllm.__version__
    version = Version(installed)
    for key in SUPPORTED_VLLM:
        if version.release == Version(key).release and not version.is_prerelease:
            return key
    raise IncompatibleVLLMError(
        f"vllm-kvreuse {_own_version()} supports vLLM "
        f"{', '.join(SUPPORTED_VLLM)} only, but vLLM {installed} is installed. "
        "Install a supported vLLM (pip install 'vllm-kvreuse[cpu]' or '[cuda]'; "
        "Ascend: docs/ascend.md) or uninstall vllm-kvreuse."
    )


def check_vllm_version(installed: str | None = None) -> None:
    """Raises :class:`IncompatibleVLLMError` unless vLLM is a supported release."""
    supported_release(installed)


def _own_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm-kvreuse")
    except PackageNotFoundError:
        return "(source)"
