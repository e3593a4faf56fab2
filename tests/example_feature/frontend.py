"""The request-label feature's frontend side: final outputs counted."""

from __future__ import annotations

from typing import Any

from tests.example_feature.metrics import count_final_output


def on_final_output(
    request_state: Any, output: Any, finish_reason: Any, stop_reason: Any
) -> None:
    """The spec's ``on_final_output``: counts ``output`` by its finish reason."""
    count_final_output(output.finish_reason)
