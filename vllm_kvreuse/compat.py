"""The vLLM release this plugin is built against, and the check on load."""

from __future__ import annotations

from packaging.version import Version

PINNED_VLLM_VERSION = "0.32.0"


class IncompatibleVLLMError(RuntimeError):
    """Raised on load when the installed vLLM is not the pinned release."""


def check_vllm_version(installed: str | None = None) -> None:
    """Raises :class:`IncompatibleVLLMError` unless vLLM is the pinned release.

    Local builds (``0.32.0+cpu``) and post releases of it are accepted; other
    releases and pre-releases are not.
    """
    if installed is None:
        import vllm

        installed = vllm.__version__
    version = Version(installed)
    is_pinned = version.release == Version(PINNED_VLLM_VERSION).release
    if not is_pinned or version.is_prerelease:
        raise IncompatibleVLLMError(
            f"vllm-kvreuse {_own_version()} supports vLLM {PINNED_VLLM_VERSION} "
            f"only, but vLLM {installed} is installed. Install the matching "
            "build (pip install 'vllm-kvreuse[cpu]', '[cuda]' or '[ascend]') "
            "or uninstall vllm-kvreuse."
        )


def _own_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm-kvreuse")
    except PackageNotFoundError:
        return "(source)"
