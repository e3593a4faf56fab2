"""Builds the enabled scheduler features, in the top floor's list order.

Core names no feature: the list is :data:`vllm_kvreuse.features.SPECS`, and
the settings the layer is given (:class:`~vllm_kvreuse.core.spec.Settings`)
name the enabled ones in that (hook-call) order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_kvreuse.core.spec import FeatureSpec, load_hook

if TYPE_CHECKING:
    from vllm_kvreuse.core.context import Core
    from vllm_kvreuse.core.feature import Feature


def feature_class(spec: FeatureSpec) -> type[Feature]:
    """Imports ``spec``'s scheduler feature class; its ``name`` is the spec's."""
    cls: type[Feature] = load_hook(spec.feature)
    assert cls.name == spec.name, f"{spec.feature} is named {cls.name!r}"
    return cls


def build_features(core: Core) -> list[Feature]:
    """The enabled features, in hook-call order."""
    return [feature_class(spec)(core) for spec in core.config.features]
