"""The request-label feature's counter in ``/metrics``."""

from __future__ import annotations

from vllm_kvreuse.metrics import counter


def count_final_output(finish_reason: str | None) -> None:
    counter(
        "example_final_outputs",
        "Final outputs the frontend built, by finish reason (test example).",
        ("finish_reason",),
    ).labels(finish_reason=str(finish_reason)).inc()
