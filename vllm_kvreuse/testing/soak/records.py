"""One line per HTTP request of a soak, and what it was expected to answer."""

from __future__ import annotations

from dataclasses import dataclass

TIMEOUT = "timeout"


@dataclass(slots=True)
class Record:
    """An HTTP request the soak made and how it ended.

    ``expect`` is ``"200"``, ``"404"`` or ``"4xx"``. ``status`` is None when
    no answer came: the per-request time limit ran out (``error`` is
    :data:`TIMEOUT`) or the connection failed. ``problem`` names a broken
    expectation beyond the status (a threshold request that was admitted, a
    stream without ``[DONE]``).
    """

    kind: str
    expect: str
    start: float  # seconds since the load started
    status: int | None = None
    latency: float = 0.0
    finish_reason: str | None = None
    error: str | None = None
    problem: str | None = None

    @property
    def timed_out(self) -> bool:
        return self.status is None and self.error == TIMEOUT

    @property
    def is_5xx(self) -> bool:
        return self.status is not None and self.status >= 500

    @property
    def status_as_expected(self) -> bool:
        if self.status is None:
            return False
        if self.expect == "4xx":
            return 400 <= self.status < 500
        return str(self.status) == self.expect

    @property
    def ok(self) -> bool:
        return self.status_as_expected and self.problem is None

    def describe(self) -> str:
        """One line for reports: kind, status, latency, what went wrong."""
        status = "no answer" if self.status is None else str(self.status)
        what = self.problem or self.error or ""
        return (
            f"{self.kind} at {self.start:.1f}s: {status} (expected {self.expect}) "
            f"in {self.latency:.1f}s {what[:200]}"
        ).rstrip()
