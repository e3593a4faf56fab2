"""Answer paths' pure parts: the paths of a prompt, a path's score from
either runner's prompt log-probs, and the hasher that stops at a prefix."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.outputs import LogprobsTensors

from vllm_kvreuse.chunk_cache.paths.modes import (
    Ballots,
    Path,
    parse_attention,
    paths_of,
    prefix_hasher,
    question_score,
)


def test_one_path_per_document_none_for_one_document() -> None:
    prompt = [1, 2, 10, 11, 12, 20, 21, 7, 8]
    paths = paths_of(prompt, [2, 3, 2])
    assert [p.tokens for p in paths] == [[1, 2, 10, 11, 12, 7, 8], [1, 2, 20, 21, 7, 8]]
    assert [p.prefix for p in paths] == [5, 4]
    assert [p.lengths for p in paths] == [[2, 3], [2, 2]]
    assert paths_of(prompt, [2, 5]) == []


def _logprobs(values: list[float]) -> LogprobsTensors:
    rows = torch.tensor(values).unsqueeze(1)
    return LogprobsTensors(torch.zeros_like(rows, dtype=torch.int64), rows, rows)


@pytest.mark.parametrize("cached_rows", [0, 3])
def test_the_score_sums_the_question_after_its_first_token(cached_rows: int) -> None:
    """Six tokens, prefix 3: rows 3 and 4 score tokens 4 and 5. V1 returns
    every row (cached ones unset), V2 only the rows it computed."""
    every_row = [9.0, 9.0, 9.0, -1.0, -2.0]
    score = question_score(_logprobs(every_row[cached_rows:]), 6, 3)
    assert score == -3.0


def test_the_prefix_hasher_hashes_past_the_prefix_at_random() -> None:
    class Request:
        block_hashes: list[bytes] = []

    hashes = [bytes([i]) * 32 for i in range(4)]
    hasher = prefix_hasher(lambda request: hashes[len(request.block_hashes) :], 4, 9)
    request = Request()
    first = hasher(request)
    assert first[:2] == hashes[:2]  # 2 full blocks of the prefix
    assert len(first) == 4 and hashes[2] not in first and hashes[3] not in first
    assert first[2:] != hasher(request)[2:]  # never the same twice
    request.block_hashes = hashes[:3]
    assert len(hasher(request)) == 1 and hasher(request) != hashes[3:]


def test_a_ballot_is_decided_once_every_path_is_scored() -> None:
    ballots = Ballots()

    class Request:
        request_id = "r"

    paths = {"s0": Path([1, 2, 3], 0, 1), "s1": Path([4, 5, 6], 0, 1)}
    ballots.open(Request(), paths)  # type: ignore[arg-type]
    assert ballots.score("s0", _logprobs([-1.0, -1.0])) is None
    ballot = ballots.score("s1", _logprobs([-1.0, -0.5]))
    assert ballot is not None and ballot.winner() is paths["s1"]
    assert ballots.close("r") == ["s0", "s1"]
    assert ballots.ballot_of("s0") is None


def test_attention_modes_are_checked() -> None:
    assert parse_attention("paths") == "paths"
    with pytest.raises(ValueError, match="joint, paths"):
        parse_attention("isolated")
