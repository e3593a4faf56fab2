"""The request-label feature's scheduler side: a tally of live requests' labels."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from vllm.v1.request import Request

from tests.example_feature.spec import REQUEST_LABEL
from vllm_kvreuse.core.feature import Feature

if TYPE_CHECKING:
    from vllm_kvreuse.core.context import Core


class RequestLabels(Feature):
    """Counts the labels of the client requests the scheduler holds."""

    name = "request_labels"

    def __init__(self, core: Core) -> None:
        super().__init__(core)
        self._labels: dict[str, str] = {}

    def on_add(self, request: Request) -> None:
        extra_args = request.sampling_params.extra_args or {}
        if (label := extra_args.get(REQUEST_LABEL)) is not None:
            self._labels[request.request_id] = label

    def on_finish(self, request: Request) -> None:
        self._labels.pop(request.request_id, None)

    @property
    def live_labels(self) -> Counter[str]:
        """How many live requests carry each label."""
        return Counter(self._labels.values())
