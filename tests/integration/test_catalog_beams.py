"""Catalog-constrained beam search through a real engine (offline LLM API).

On random weights an open-vocabulary beam almost never spells a catalog
item; constrained beams always do, and with a width that covers the whole
catalog they return every item ranked by its log-probability under the
model, which the Hugging Face reference computes independently.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from vllm import LLM
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import BeamSearchParams

from tests.integration.conftest import make_llm, reference_tolerance
from vllm_kvreuse.beam.catalog.processor import mask_with_sink
from vllm_kvreuse.beam.frontend import catalog_beam_params

pytestmark = pytest.mark.usefixtures("no_leak")

ITEMS = [
    (100, 1200, 2300), (100, 1200, 2301), (100, 1250, 2300),
    (101, 1201, 2302), (107, 1300, 2400), (108, 1301, 2401),
]  # fmt: skip
PROMPTS = [{"prompt_token_ids": [(7 * s + 3 * i) % 3000 + 50 for i in range(40 + s)]}
           for s in range(3)]  # fmt: skip


@pytest.fixture(scope="module")
def catalog_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("catalog") / "items.txt"
    lines = [
        "# sid-catalog v1",
        "# layout: tokens",
        *(" ".join(map(str, i)) for i in ITEMS),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def llm(model_dir: str, catalog_file: Path) -> Iterator[LLM]:
    engine = make_llm(
        model_dir, engine_beam_search=True, sid_catalog=str(catalog_file),
        logprobs_mode="processed_logprobs",
    )  # fmt: skip
    yield engine
    del engine


def generated(llm: LLM, params: BeamSearchParams) -> list[list[tuple[int, ...]]]:
    outputs = llm.beam_search(PROMPTS, params)
    return [
        [tuple(seq.tokens[len(p["prompt_token_ids"]) :]) for seq in out.sequences]
        for p, out in zip(PROMPTS, outputs, strict=True)
    ]


def test_every_constrained_beam_is_a_catalog_item(llm: LLM) -> None:
    constrained = generated(llm, catalog_beam_params(beam_width=4, max_tokens=3))
    assert all(item in ITEMS for beams in constrained for item in beams)
    assert all(len(beams) == 4 for beams in constrained)
    free = generated(llm, BeamSearchParams(beam_width=4, max_tokens=3))
    assert not any(item in ITEMS for beams in free for item in beams)


@torch.no_grad()
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_full_width_search_ranks_every_item_as_the_model_does(
    llm: LLM, hf_model, ignore_eos: bool
) -> None:
    """Width 8 covers the 6 items: the beams are all of them, ordered by
    their log-probability under the HF reference model (with ``ignore_eos``
    from rows of the top ``width`` log-probs, not ``2 * width``)."""
    params = catalog_beam_params(beam_width=8, max_tokens=3, ignore_eos=ignore_eos)
    (got,) = llm.beam_search(PROMPTS[:1], params)
    prompt = PROMPTS[0]["prompt_token_ids"]
    scores = {}
    for item in ITEMS:
        ids = torch.tensor([prompt + list(item)])
        logprobs = hf_model(ids).logits[0].log_softmax(-1)
        scores[item] = sum(
            logprobs[len(prompt) - 1 + k, token].item() for k, token in enumerate(item)
        )
    expected = sorted(ITEMS, key=scores.__getitem__, reverse=True)
    items = [tuple(seq.tokens[len(prompt) :]) for seq in got.sequences]
    assert items == expected
    tolerance = 3 * reference_tolerance(llm, hf_model)  # a sum of three log-probs
    for seq, item in zip(got.sequences, items, strict=True):
        assert seq.cum_logprob == pytest.approx(scores[item], abs=tolerance)


def test_catalog_beams_need_whole_items(llm: LLM) -> None:
    with pytest.raises(VLLMValidationError, match="3 tokens long"):
        llm.beam_search(PROMPTS[:1], catalog_beam_params(beam_width=2, max_tokens=2))


def test_the_mask_keeps_every_allowed_log_prob_exact() -> None:
    logits = torch.randn(3, 50)
    allowed = torch.zeros(3, 50, dtype=torch.bool)
    allowed[0, [4, 9]] = True
    allowed[1, 0] = True  # the sink is then column 1
    allowed[2, :] = True  # nothing to sink
    masked = mask_with_sink(logits.clone(), allowed)
    raw, kept = logits.log_softmax(-1), masked.log_softmax(-1)
    torch.testing.assert_close(kept[allowed], raw[allowed])
    assert torch.isinf(kept[0][~allowed[0]]).sum() == 50 - 2 - 1  # one sink
    assert torch.isfinite(kept[1, 1]) and torch.isinf(kept[1, 2:]).all()
