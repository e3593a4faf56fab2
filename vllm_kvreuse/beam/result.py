"""How a beam group's result travels from the engine core to the frontend.

The result rides in the root request's final output as its ``stop_reason``:
a tagged JSON string (:data:`TAG`). The root is the plugin's own request
(the frontend wrapper sends it and consumes its one final output, turning
it into the response vLLM's loop would have produced), so no client ever
sees that stop reason, and nothing else writes it: a P/D connector writes
``kv_transfer_params``, which a root prefilled remotely legitimately
carries (the group's final output passes the root's on unchanged), so the
result must not ride there.

A final output without the tag (a rejection, an abort, an error) is the
engine's own answer and is passed on as it is.

Invariant: :func:`decode` of :func:`encode` of a result is that result,
log-probs bit for bit, ``-inf`` included (stdlib JSON keeps non-finite
floats; msgspec's encoder would turn them into ``null``).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

TAG = "kvreuse_beams:"
"""Prefix of a root's ``stop_reason`` that carries a :class:`BeamResult`."""


class BeamOut(msgspec.Struct, frozen=True):
    """One returned beam: its generated tokens (prompt excluded)."""

    token_ids: list[int]
    cum_logprob: float
    finish_reason: str
    stop_reason: int | str | None = None


class BeamResult(msgspec.Struct, frozen=True):
    """The best beams, best first, and the group's counters for /metrics."""

    beams: list[BeamOut]
    forks: int = 0
    copied_blocks: int = 0
    member_computed_tokens: int = 0
    steps_as_one: int = 0


def encode(result: BeamResult) -> str:
    """``result`` as a root's ``stop_reason``."""
    return TAG + json.dumps(msgspec.to_builtins(result), separators=(",", ":"))


def decode(stop_reason: Any) -> BeamResult | None:
    """The result in a root's ``stop_reason``; None if it carries none."""
    if not isinstance(stop_reason, str) or not stop_reason.startswith(TAG):
        return None
    return msgspec.convert(json.loads(stop_reason[len(TAG) :]), type=BeamResult)
