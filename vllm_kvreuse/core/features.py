"""Builds the enabled scheduler features, in the top floor's list order.

Core names no feature: the list is :data:`vllm_kvreuse.features.SPECS`, and
:attr:`vllm_kvreuse.config.KVReuseConfig.features` gives the enabled ones in
that (hook-call) order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_kvreuse.core.context import Core
    from vllm_kvreuse.core.feature import Feature


def build_features(core: Core) -> list[Feature]:
    """The enabled features, in hook-call order."""
    return [spec.feature_class()(core) for spec in core.config.features]
