"""The beam-search step rule on hand-made log-prob rows."""

from __future__ import annotations

import numpy as np
import pytest
from vllm.entrypoints.generate.beam_search.utils import BeamSearchSequence

from vllm_kvreuse.beam.rule import Beam, BeamConfig, best, expand, logprob_row

EOS = 2


def beam(tokens: list[int], cum: float, request_id: str) -> Beam:
    seq = BeamSearchSequence(
        orig_prompt=None, tokens=tokens, logprobs=[], cum_logprob=cum
    )
    return Beam(seq, request_id)


def config(width: int = 2, **kwargs) -> BeamConfig:
    return BeamConfig(width=width, max_tokens=3, eos_token_id=EOS, **kwargs)


def test_row_keeps_sampled_first_and_drops_duplicates() -> None:
    # The sampler puts the sampled token first; it repeats in the top-k.
    row = logprob_row([7, 7, 9, 4, 5, 6], [-0.1, -0.1, -0.5, -0.9, -1.0, -2.0], size=4)
    assert list(row.items()) == [(7, -0.1), (9, -0.5), (4, -0.9), (5, -1.0)]


def test_best_candidates_across_beams_win() -> None:
    beams = [beam([1, 10], -1.0, "a"), beam([1, 11], -0.2, "b")]
    rows = [{20: -0.1, 21: -3.0}, {30: -0.5, 31: -0.6}]
    step = expand(beams, rows, config(width=2))
    assert [(seq.tokens[-1], parent) for seq, parent in step.beams] == [
        (30, "b"),
        (31, "b"),
    ]
    assert step.beams[0][0].cum_logprob == -0.7


def test_eos_completes_a_beam_unless_ignored() -> None:
    beams = [beam([1, 10], 0.0, "a")]
    step = expand(beams, [{EOS: -0.1, 5: -1.0}], config(width=1))
    assert [s.tokens for s in step.completed] == [[1, 10]]
    assert step.completed[0].finish_reason == "stop"
    assert [s.tokens for s, _ in step.beams] == [[1, 10, 5]]
    kept = expand(beams, [{EOS: -0.1, 5: -1.0}], config(width=1, ignore_eos=True))
    assert kept.completed == [] and kept.beams[0][0].tokens == [1, 10, EOS]
    shown = expand(
        beams, [{EOS: -0.1}], config(width=1, include_stop_str_in_output=True)
    )
    assert shown.completed[0].tokens == [1, 10, EOS]


def test_final_ranking_uses_the_length_penalised_score() -> None:
    short = BeamSearchSequence(
        orig_prompt=None, tokens=[1, 2], logprobs=[], cum_logprob=-1.0
    )
    long = BeamSearchSequence(
        orig_prompt=None, tokens=[1, 2, 3, 4], logprobs=[], cum_logprob=-1.5
    )
    assert best([short], [long], config(width=1, length_penalty=1.0)) == [long]
    assert best([short], [long], config(width=1, length_penalty=0.0)) == [short]


def loop_expand(beams: list[Beam], rows: list[dict[int, float]], cfg: BeamConfig):
    """The rule one candidate at a time, as the front end writes it, with
    one total order for ties (``sorted`` is stable; candidates are listed
    beam by beam, by token id): the reference the vectorised ``expand``
    must match, ties included."""
    completed, candidates = [], []
    for index, (b, row) in enumerate(zip(beams, rows, strict=True)):
        for token, logprob in sorted(row.items()):
            cum = b.seq.cum_logprob + logprob
            if cum == float("-inf"):
                continue
            if token == cfg.eos_token_id and not cfg.ignore_eos:
                completed.append((b.request_id, cum))
            else:
                candidates.append((cum, index, token, b.request_id))
    ranked = sorted(candidates, key=lambda c: -c[0])[: cfg.width]
    return completed, [(token, rid, cum) for cum, _, token, rid in ranked]


@pytest.mark.parametrize("seed", range(20))
def test_vectorised_step_selects_what_the_per_candidate_loop_selects(seed: int) -> None:
    rng = np.random.default_rng(seed)
    width = int(rng.choice([1, 3, 8, 32]))
    beams = [
        beam([1, 2 + i], float(rng.choice([0.0, -1.0])), f"b{i}") for i in range(width)
    ]
    rows = []
    for _ in beams:
        k = int(rng.integers(0, 2 * width + 2))
        # Few distinct values and a small vocabulary: many ties, EOS often.
        # As vLLM's sampler lists them: the sampled token, then the top-k
        # (distinct), which may hold the sampled token again.
        top = rng.choice(max(12, k), size=max(k - 1, 0), replace=False).tolist()
        tokens = [int(rng.integers(0, 12)), *top][:k]
        values = rng.choice([-0.5, -1.0, -1.5], size=k).tolist()
        rows.append(logprob_row(tokens, values, 2 * width))
    cfg = config(width=width, ignore_eos=bool(seed % 3 == 0))
    completed, selected = loop_expand(beams, [dict(r.items()) for r in rows], cfg)
    step = expand(beams, rows, cfg)
    assert [(s.stop_reason, s.cum_logprob) for s in step.completed] == [
        (EOS, cum) for _, cum in completed
    ]
    assert [(s.tokens[-1], p, s.cum_logprob) for s, p in step.beams] == selected


def test_row_size_is_width_only_when_no_candidate_can_end_a_beam() -> None:
    assert config(width=8).row_size == 16
    assert config(width=8, ignore_eos=True).row_size == 8
    assert BeamConfig(width=8, max_tokens=3, eos_token_id=None).row_size == 8
    assert config(width=8, ignore_eos=True, sid_catalog=True).num_logprobs == 9


@pytest.mark.parametrize("seed", range(10))
def test_top_width_rows_keep_the_beams_of_top_twice_width_rows(seed: int) -> None:
    """With ``ignore_eos``, rows cut to ``row_size`` select what vLLM's
    ``2 * width`` rows select (distinct scores: no ties at the cut)."""
    rng = np.random.default_rng(seed)
    width = int(rng.choice([1, 3, 8, 32]))
    cfg = config(width=width, ignore_eos=True)
    beams = [beam([1, 2 + i], float(rng.normal()), f"b{i}") for i in range(width)]
    full, cut = [], []
    for _ in beams:
        values = np.sort(rng.normal(size=2 * width + 1))[::-1].tolist()
        tokens = rng.choice(1000, size=2 * width, replace=False).tolist()
        tokens = [tokens[0], *tokens]  # the sampled (best) token, then the top-k
        values = [values[1], *values[1:]]
        full.append(logprob_row(tokens, values, 2 * width))
        cut.append(logprob_row(tokens, values, cfg.row_size))
    assert all(len(row) == width for row in cut)
    want = [(s.tokens, p, s.cum_logprob) for s, p in expand(beams, full, cfg).beams]
    got = [(s.tokens, p, s.cum_logprob) for s, p in expand(beams, cut, cfg).beams]
    assert got == want
