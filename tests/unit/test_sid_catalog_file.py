"""The --sid-catalog file: good files, every kind of bad one, the setting."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from vllm_kvreuse.beam.catalog import file as catalog_file
from vllm_kvreuse.beam.catalog.file import load_catalog, parse_catalog
from vllm_kvreuse.beam.catalog.load import PROCESSOR
from vllm_kvreuse.config import ADDITIONAL_CONFIG_KEY, KVReuseConfig
from vllm_kvreuse.core.options import parse_file

VOCAB = 100
CODES = "# sid-catalog v1\n# layout: codes\n# codebooks: 4 8 4\n"
OFFSETS = CODES + "# token-offsets: 10 20 30\n"


def parse(text: str | bytes, **kwargs) -> tuple[list[list[int]], list[int]]:
    data = text.encode() if isinstance(text, str) else text
    items, lines = parse_catalog(data, VOCAB, source="cat.txt", **kwargs)
    return items.tolist(), lines.tolist()


def test_codes_with_token_offsets() -> None:
    text = OFFSETS + "\n# a comment: with a colon\n1 2 3\n0,7,0\n\n3\t0 1\n1 2 3"
    items, lines = parse(text)
    assert items == [[11, 22, 33], [10, 27, 30], [13, 20, 31], [11, 22, 33]]
    assert lines == [7, 8, 10, 11]


def test_crlf_and_trailing_spaces_are_fine() -> None:
    text = OFFSETS.replace("\n", "\r\n") + "1 2 3 \r\n 0 0 0\r\n"
    assert parse(text)[0] == [[11, 22, 33], [10, 20, 30]]


def test_codes_with_a_token_pattern() -> None:
    vocab = {
        f"<s_{c}_{i}>": 40 + 10 * k + i for k, c in enumerate("abc") for i in range(8)
    }
    text = CODES + "# token-pattern: <s_a_{}> <s_b_{}> <s_c_{}>\n1 7 2\n"
    assert parse(text, vocab=vocab)[0] == [[41, 57, 62]]


def test_token_ids() -> None:
    text = "# sid-catalog v1\n# layout: tokens\n5 6 7 8\n5 6 9 9\n"
    assert parse(text) == ([[5, 6, 7, 8], [5, 6, 9, 9]], [3, 4])


def test_load_builds_the_trie_and_counts_duplicates_once(tmp_path: Path) -> None:
    path = tmp_path / "cat.txt"
    path.write_text(OFFSETS + "1 2 3\n1 2 3\n1 2 0\n")
    catalog = load_catalog(path, VOCAB, eos_token_id=0)
    assert catalog.num_items == 2
    assert catalog.items().tolist() == [[11, 22, 30], [11, 22, 33]]


PATTERN = CODES + "# token-pattern: <s_a_{}> <s_b_{}> <s_c_{}>\n"
BAD = [
    ("", "cat.txt: empty file"),
    ("1 2 3\n", "cat.txt:1: a SID catalog starts with"),
    ("# sid-catalog v2\n# layout: tokens\n1\n", "cat.txt:1: a SID catalog starts"),
    ("# sid-catalog v1\n1 2\n", "missing the header line '# layout"),
    ("# sid-catalog v1\n# layout: trie\n1\n", ":2: layout must be codes or tokens"),
    (
        "# sid-catalog v1\n# layout: codes\n1\n",
        ":2: layout: codes needs '# codebooks:'",
    ),
    (CODES.replace("4 8 4", "4 x 4") + "1 2 3\n", ":3: 'codebooks' must list integers"),
    (CODES.replace("4 8 4", "4 0 4") + "1 2 3\n", ":3: 'codebooks' values must be at"),
    (CODES + "1 2 3\n", ":2: layout: codes needs exactly one of"),
    (PATTERN + "# token-offsets: 1 2 3\n1 2 3\n", "needs exactly one of"),
    (CODES + "# token-offsets: 10 20\n1 2 3\n", ":4: 2 token offsets for 3 codebooks"),
    (
        CODES + "# token-offsets: 0 0 97\n1 2 3\n",
        ":4: codebook 2 maps to token ids up to 100",
    ),
    (CODES + "# token-pattern: a b c{}\n1 2 3\n", ":4: each token pattern holds '{}'"),
    (CODES + "# token-pattern: <{}> <{}>\n1 2 3\n", ":4: 2 token patterns for 3"),
    (PATTERN + "1 2 3\n", ":4: 'token-pattern' needs the tokenizer's vocabulary"),
    (
        OFFSETS + "# layout: tokens\n1 2 3\n",
        ":5: 'layout' given twice (first on line 2)",
    ),
    (OFFSETS + "1 2 3\n1 2\n", ":6: expected 3 values, got 2 (line: '1 2')"),
    (OFFSETS + "1 2 3\n1 2 3 0\n", ":6: expected 3 values, got 4"),
    (OFFSETS + "1 2 3\n\n1 8 3\n", ":7: code 8 outside codebook 1 (size 8)"),
    (OFFSETS + "1 -2 3\n", ":5: an item is a list of non-negative integers"),
    (OFFSETS + "1 2.0 3\n", ":5: an item is a list of non-negative integers"),
    (OFFSETS + "1 2 3\n# late comment\n", ":6: an item is a list of non-negative"),
    (OFFSETS + "1 2 3\n1 2 \xe9\n", ":6: an item is a list of non-negative"),
    (OFFSETS + "1 2 3\n1 2 99999999999999999999\n", ":6: value too large"),
    (OFFSETS, "cat.txt: no items"),
    (OFFSETS + "\n\n", "cat.txt: no items"),
    ("# sid-catalog v1\n# layout: tokens\n# codebooks: 4\n1\n", ":3: 'codebooks' does"),
    (
        "# sid-catalog v1\n# layout: tokens\n1 2\n1 2 3\n",
        ":4: expected 2 values, got 3",
    ),
    ("# sid-catalog v1\n# layout: tokens\n1 2\n1 100\n", ":4: token id outside the"),
    ("# sid-catalog v1\n# layout: tokens\n" + "1 " * 17 + "\n", ":3: 17 tokens per"),
    (
        CODES.replace("4 8 4", "2 " * 17) + "# token-offsets: 1\n",
        ":3: at most 16 codebooks",
    ),
]


@pytest.mark.parametrize(("text", "message"), BAD)
def test_a_bad_catalog_is_refused_with_its_line(text: str, message: str) -> None:
    with pytest.raises(ValueError) as error:
        parse(text)
    assert message in str(error.value)


def test_a_missing_pattern_token_is_named() -> None:
    vocab = {f"<s_{c}_{i}>": i for c in "abc" for i in range(8) if (c, i) != ("c", 3)}
    with pytest.raises(ValueError, match=r":4: token '<s_c_3>' \(codebook 2, code 3\)"):
        parse(PATTERN + "1 2 3\n", vocab=vocab)


def test_an_oversized_catalog_is_refused_with_the_count(tmp_path: Path) -> None:
    text = OFFSETS + "1 2 3\n\n" * 4
    assert len(parse(text, max_items=4)[0]) == 4  # blank lines do not count
    with pytest.raises(ValueError, match=r"cat\.txt: 4 items, over the limit of 3"):
        parse(text, max_items=3)
    path = tmp_path / "big.txt"
    path.write_text(text)
    limit = catalog_file.MAX_FILE_BYTES
    try:
        catalog_file.MAX_FILE_BYTES = path.stat().st_size - 1
        with pytest.raises(
            ValueError, match=r"big.txt: SID catalog of \d+ bytes is over"
        ):
            load_catalog(path, VOCAB)
    finally:
        catalog_file.MAX_FILE_BYTES = limit


def test_load_refuses_eos_inside_an_item_and_unreadable_files(tmp_path: Path) -> None:
    path = tmp_path / "cat.txt"
    path.write_text(OFFSETS + "1 2 3\n1 0 0\n")
    load_catalog(path, VOCAB, eos_token_id=21)  # token 21 = code 1 of codebook 1
    with pytest.raises(ValueError, match=r"cat.txt:5: item contains the EOS token 22"):
        load_catalog(path, VOCAB, eos_token_id=22)
    with pytest.raises(ValueError, match=r"nope\.txt: cannot read the SID catalog"):
        load_catalog(tmp_path / "nope.txt", VOCAB)


def test_a_large_catalog_parses_the_same_as_python(tmp_path: Path) -> None:
    """The vectorised parser against int() on every line of 20,000 items."""
    rng = np.random.default_rng(0)
    items = rng.integers(0, [4, 8, 4], size=(20_000, 3))
    lines = [" ".join(map(str, item)) for item in items.tolist()]
    parsed, numbers = parse(OFFSETS + "\n".join(lines) + "\n")
    assert parsed == [[10 + a, 20 + b, 30 + c] for a, b, c in items.tolist()]
    assert numbers == list(range(5, 5 + len(lines)))


# -- the setting ---------------------------------------------------------------


def test_setting_is_off_by_default_and_checks_the_file(tmp_path: Path) -> None:
    assert KVReuseConfig().sid_catalog == ""
    assert parse_file("", "--sid-catalog") == ""
    path = tmp_path / "cat.txt"
    path.write_text(OFFSETS + "1 2 3\n")
    assert KVReuseConfig.from_dict({"sid_catalog": str(path)}).sid_catalog == str(path)
    for bad in (str(tmp_path / "missing.txt"), str(tmp_path), 3):
        with pytest.raises(ValueError, match="--sid-catalog"):
            parse_file(bad, "--sid-catalog")


def test_cli_flag_reaches_additional_config(tmp_path: Path) -> None:
    path = tmp_path / "cat.txt"
    path.write_text(OFFSETS + "1 2 3\n")
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", "m", "--sid-catalog", str(path)])
    with pytest.raises(ValueError, match="needs --engine-beam-search"):
        AsyncEngineArgs.from_cli_args(args)
    catalog_args = ["--sid-catalog", str(path), "--engine-beam-search"]
    args = parser.parse_args(["--model", "m", *catalog_args])
    with pytest.raises(ValueError, match="--logprobs-mode processed_logprobs"):
        AsyncEngineArgs.from_cli_args(args)
    args = parser.parse_args(
        ["--model", "m", *catalog_args, "--logprobs-mode", "processed_logprobs"]
    )
    engine_args = AsyncEngineArgs.from_cli_args(args)
    assert engine_args.additional_config[ADDITIONAL_CONFIG_KEY] == {
        "sid_catalog": str(path),
        "engine_beam_search": True,
    }
    assert PROCESSOR in engine_args.logits_processors
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--sid-catalog", str(tmp_path / "no.txt")])
