"""Answer paths' pure parts: the paths of a prompt (documents only), a
path's score from either runner's prompt log-probs, the documents choose
keeps, and the hasher that stops at a prefix."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.outputs import LogprobsTensors

from vllm_kvreuse.chunk_cache.paths.ballot import Ballot, Ballots, Choice
from vllm_kvreuse.chunk_cache.paths.modes import (
    Path,
    kept_documents,
    layout_of,
    parse_attention,
    parse_documents,
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


def test_turns_after_the_documents_stand_in_every_path() -> None:
    """Chunks 1 and 2 are documents; chunk 3 (a conversation's turn) and the
    question follow each document, and are what a path's score sums."""
    prompt = [1, 10, 11, 20, 30, 31, 7]
    layout = layout_of(prompt, [1, 2, 1, 2], [1, 3])
    assert layout is not None
    paths = [layout.path(d) for d in range(2)]
    assert [p.tokens for p in paths] == [[1, 10, 11, 30, 31, 7], [1, 20, 30, 31, 7]]
    assert [p.prefix for p in paths] == [3, 2]
    assert layout.prompt([1, 0]) == ([1, 20, 10, 11, 30, 31, 7], [1, 1, 2, 2])
    assert layout_of(prompt, [1, 2, 1, 2], [2, 3]) is None  # one document


def test_choose_keeps_the_close_documents_in_the_clients_order() -> None:
    def path(document: int, per_token: float) -> Path:
        return Path([0] * 7, [1, 1], 2, document, score=per_token * 4)

    paths = [path(0, -2.0), path(1, -1.0), path(2, -1.05), path(3, -1.08)]
    assert kept_documents(paths, 0.1, 2) == [1, 2]
    assert kept_documents(paths, 0.1, 4) == [1, 2, 3]
    assert kept_documents(paths, 0.0, 4) == [1]
    assert kept_documents(paths, 5.0, 0) == [1]  # at least one


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


@pytest.mark.parametrize("mode, kept", [("paths", [1]), ("choose", [0, 1])])
def test_a_ballot_is_decided_once_every_path_is_scored(mode: str, kept: list) -> None:
    ballots = Ballots()

    class Request:
        request_id = "r"

    layout = layout_of([1, 2, 3, 4, 5, 6], [1, 1, 1])
    assert layout is not None
    ballot = Ballot(Request(), layout, Choice(mode, 1.0, 2))  # type: ignore[arg-type]
    ballot.paths = {"s0": layout.path(0), "s1": layout.path(1)}
    ballots.open(ballot)
    assert ballots.score("s0", _logprobs([-1.0, -1.0, -1.0, -1.0])) is None
    assert ballots.score("s1", _logprobs([-1.0, -1.0, -1.0, -0.5])) is ballot
    assert ballot.winner() is ballot.paths["s1"] and ballot.kept() == kept
    assert ballots.close("r") == ["s0", "s1"]
    assert ballots.ballot_of("s0") is None


def test_attention_modes_and_documents_are_checked() -> None:
    assert parse_attention("choose") == "choose"
    with pytest.raises(ValueError, match="joint, paths, choose"):
        parse_attention("isolated")
    assert parse_documents([1, 3]) == [1, 3]
    for bad in ([0, 2], [3, 2], [1], "13", [1.0, 2]):
        with pytest.raises(ValueError, match="first, end"):
            parse_documents(bad)
