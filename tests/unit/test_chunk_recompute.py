"""Which chunk tokens a request recomputes, and the plan's segments."""

from __future__ import annotations

import pytest

from vllm_kvreuse.chunk_cache.engine.plan import ChunkPlan, PlannedChunk
from vllm_kvreuse.chunk_cache.engine.recompute import (
    Recompute,
    choose_spans,
    clip,
    merge,
    parse_recompute,
)

# system prompt (4), documents of 10, 12 and 8 tokens, question (3)
SYSTEM = [1, 2, 3, 4]
DOCS = [list(range(100, 110)), list(range(200, 212)), list(range(300, 308))]
LENGTHS = [4, 10, 12, 8]  # chunks start at 0, 4, 14, 26; they end at 34


def prompt(question: list[int]) -> list[int]:
    return [*SYSTEM, *DOCS[0], *DOCS[1], *DOCS[2], *question]


def test_head_recomputes_each_chunk_after_the_system_prompt() -> None:
    spans = choose_spans(prompt([9, 9, 9]), LENGTHS, Recompute(head=3))
    assert spans == [(4, 7), (14, 17), (26, 29)]


def test_a_head_longer_than_a_chunk_covers_it_and_runs_into_the_next() -> None:
    spans = choose_spans(prompt([9]), LENGTHS, Recompute(head=11))
    assert spans == [(4, 25), (26, 34)]


def test_select_spends_its_budget_on_the_chunks_sharing_rare_question_tokens() -> None:
    """The question names tokens of the second document: that one first;
    a token in every document counts nothing."""
    shared = [100, 200, 300]  # in every document: no signal
    question = [*shared, 205, 206]
    spans = choose_spans(prompt(question), LENGTHS, Recompute(select=0.4))
    assert spans == [(14, 26)]  # budget round(0.4 * 30) = 12 = the whole doc
    spans = choose_spans(prompt(question), LENGTHS, Recompute(select=0.2))
    assert spans == [(14, 20)]  # 6 tokens, from the document's start


def test_select_picks_nothing_without_a_rare_question_token() -> None:
    assert choose_spans(prompt([9, 9]), LENGTHS, Recompute(select=0.5)) == []


def test_tail_is_a_share_of_all_chunk_tokens_but_never_the_system_prompt() -> None:
    assert choose_spans(prompt([9]), LENGTHS, Recompute(tail=0.25)) == [(26, 34)]
    assert choose_spans(prompt([9]), LENGTHS, Recompute(tail=1.0)) == [(4, 34)]


def test_merge_joins_touching_and_overlapping_spans() -> None:
    assert merge([(5, 8), (1, 3), (3, 4), (7, 9), (9, 9)]) == [(1, 4), (5, 9)]


def test_the_plan_alternates_loads_and_spans() -> None:
    chunks = [
        PlannedChunk(b"k", start, length, stored_start=start)
        for start, length in zip([0, 4, 14, 26], LENGTHS, strict=True)
    ]
    plan = ChunkPlan(chunks, spans=[(4, 7), (14, 17), (30, 34)])
    assert plan.load_regions() == [(0, 4), (7, 14), (17, 30)]
    assert plan.last_load_end == 30
    assert [plan.load_stop(p) for p in (0, 4, 8, 17, 31)] == [4, 4, 14, 30, 31]
    # inside a span: stop at its end; a span reaching the question: no stop
    assert [plan.compute_stop(p) for p in (4, 15, 31, 34)] == [7, 17, None, None]
    assert plan.compute_stop(8) == 8  # a load region: load first
    assert plan.num_loaded() == 4 + 7 + 13
    assert plan.num_loaded(5, 20) == 7 + 3


@pytest.mark.parametrize(
    "value",
    ["all", {}, {"heads": 3}, {"head": -1}, {"head": True}, {"head": 5000},
     {"select": 1.5}, {"tail": "0.5"}, {"select": float("nan")}, 3, ["head"]],
)  # fmt: skip
def test_bad_chunk_recompute_values_are_refused(value) -> None:
    with pytest.raises(ValueError, match="chunk_recompute"):
        parse_recompute(value)


def test_chunk_recompute_values() -> None:
    assert parse_recompute("none") == Recompute()
    assert parse_recompute({"head": 16, "select": 0.25}) == Recompute(16, 0.25, 0.0)


def test_recomputed_spans_are_clipped_to_the_moved_chunks() -> None:
    """Rules recompute only in chunks loaded away from where they were
    computed: a new chunk is computed whole, an exact one needs nothing."""
    assert clip([(2, 9), (12, 20)], [(0, 4), (8, 14)]) == [(2, 4), (8, 9), (12, 14)]
    assert clip([(0, 5)], []) == []
    assert clip([(0, 5)], [(5, 9)]) == []
