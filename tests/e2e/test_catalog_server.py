"""Catalog-constrained beams over HTTP: the `sid_catalog` body field."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import BLOCK_SIZE
from tests.e2e.conftest import SERVED_MODEL, Server

pytestmark = pytest.mark.e2e

ITEMS = [(100, 1200, 2300), (100, 1200, 2301), (101, 1201, 2302), (108, 1301, 2401)]
PROMPT = [(5 * i) % 3000 + 60 for i in range(50)]


@pytest.fixture(scope="module")
def server(model_dir: str, tmp_path_factory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("catalog")
    catalog = folder / "items.txt"
    lines = ["# sid-catalog v1", "# layout: tokens"]
    catalog.write_text("\n".join(lines + [" ".join(map(str, i)) for i in ITEMS]))
    with Server(
        model_dir, "--engine-beam-search", "--sid-catalog", str(catalog),
        "--logprobs-mode", "processed_logprobs",
        log_path=folder / "server.log", block_size=BLOCK_SIZE,
    ) as srv:  # fmt: skip
        yield srv


def complete(server: Server, **fields) -> httpx.Response:
    body = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 3, **fields}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)


def items_of(response: httpx.Response) -> list[tuple[int, ...]]:
    assert response.status_code == 200, response.text
    return [tuple(c["token_ids"]) for c in response.json()["choices"]]


def test_constrained_beams_are_catalog_items(server: Server) -> None:
    response = complete(
        server, use_beam_search=True, n=4, sid_catalog=True, return_token_ids=True
    )
    assert sorted(items_of(response)) == sorted(ITEMS)  # width 4 covers them all
    free = complete(server, use_beam_search=True, n=4, return_token_ids=True)
    assert not set(items_of(free)) & set(ITEMS)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"use_beam_search": True, "n": 2, "sid_catalog": "yes"}, "true or false"),
        ({"sid_catalog": True}, "applies to use_beam_search"),
        ({"use_beam_search": True, "n": 2, "sid_catalog": True, "max_tokens": 2},
         "3 tokens long"),
    ],
)  # fmt: skip
def test_bad_catalog_requests_are_400(server: Server, fields, message) -> None:
    response = complete(server, **fields)
    assert response.status_code == 400 and message in response.text, response.text
