"""The chunk store's tiers through a real engine: chunks that went down to
the CPU tier and to disk (and out of the engine, across a restart) come back
up and load exactly what was stored; a damaged file or a lost shared store
costs a recomputation, never an error or another answer.

Each test sizes the tiers in tokens of the tiny model (1 KiB a token in
float32) so that one more document pushes the oldest down a tier.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vllm import SamplingParams

from tests.integration.chunks import (
    QUESTION,
    SYSTEM,
    chunk_cache_llm,
    generate,
    index_of,
)
from vllm_kvreuse.chunk_cache.frontend.segments import chunked_prompt
from vllm_kvreuse.testing.server import free_port

PLAIN = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)
GIB = 2**30


def doc(first: int) -> list[int]:
    return list(range(first, first + 64))


def tiers(
    tokens_device: int, tokens_cpu: int, disk: Path | None, size: int = 4
) -> dict:
    """Engine keyword arguments sizing the tiers in tokens of the tiny model
    (``size`` bytes an element: float32)."""
    per_token = 2 * 2 * 2 * 32 * size  # layers x K,V x KV heads x head size
    kwargs = {  # of a 1 GiB KV cache (VLLM_CPU_KVCACHE_SPACE=1, tests/conftest.py)
        "chunk_cache_device_fraction": tokens_device * per_token / GIB,
        "chunk_cache_cpu_gib": tokens_cpu * per_token / GIB,
    }
    if disk is not None:
        kwargs |= {"chunk_cache_disk_path": str(disk), "chunk_cache_disk_gib": 1}
    return kwargs


def tier_of(llm, document: list[int]) -> str:
    """The tier the store holds ``document``'s chunk in."""
    (entry,) = [
        e for e in index_of(llm).entries.values() if e.num_tokens == len(document)
        and e.start == len(SYSTEM) and e.origin == origin_of(llm, document)
    ]  # fmt: skip
    return entry.tier


def origin_of(llm, document: list[int]) -> bytes:
    from vllm_kvreuse.chunk_cache.engine.keys import Provenance

    store = (
        llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side.store
    )
    provenance = Provenance(None, store.identity)
    provenance.feed(SYSTEM)
    return provenance.origin(store.key(None, "", document))


def as_plain_vllm(llm, segments):
    """The same prompt as an ordinary request, computed whole."""
    llm.reset_prefix_cache()
    ids, _ = chunked_prompt(segments)
    (out,) = llm.generate([{"prompt_token_ids": ids}], PLAIN, use_tqdm=False)
    return out


def assert_same(a, b) -> None:
    """Same tokens, and log-probs equal to float32 rounding (loads are exact:
    a chunk loaded where it was computed gives plain vLLM's values)."""
    assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
    for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
        for token, entry in x.items():
            assert entry.logprob == pytest.approx(y[token].logprob, abs=1e-5)


def test_a_chunk_back_from_each_tier_loads_what_was_stored(model_dir, tmp_path) -> None:
    """Documents through a device tier and a CPU tier of one document each:
    the oldest goes to disk, the next to the CPU tier; back up, each loads
    exactly what it loaded from the device tier, and answers as plain vLLM."""
    docs = [doc(1000), doc(1100), doc(1200)]
    with chunk_cache_llm(model_dir, **tiers(110, 70, tmp_path)) as llm:
        warm = {}
        for number, document in enumerate(docs):
            generate(llm, [SYSTEM, document, QUESTION])
            warm[number] = generate(llm, [SYSTEM, document, [7, *QUESTION]])
        assert [tier_of(llm, d) for d in docs] == ["disk", "cpu", "device"]
        stats = index_of(llm).stats
        for number in (0, 1):
            tier = tier_of(llm, docs[number])
            hits = getattr(stats, f"{tier}_hits")
            llm.reset_prefix_cache()  # the blocks go; the stored chunks stay
            segments = [SYSTEM, docs[number], [7, *QUESTION]]
            out = generate(llm, segments)
            assert getattr(stats, f"{tier}_hits") == hits + 1
            assert out.outputs[0].logprobs == warm[number].outputs[0].logprobs
            assert_same(out, as_plain_vllm(llm, segments))
        assert stats.load_failures == 0


def test_a_restart_finds_the_disk_tier_and_ignores_another_layout(
    model_dir, tmp_path
) -> None:
    documents = [doc(2000), doc(2100), doc(2200)]
    with chunk_cache_llm(model_dir, **tiers(110, 0, tmp_path)) as llm:
        for document in documents:
            generate(llm, [SYSTEM, document, QUESTION])
        assert index_of(llm).stats.spilled >= 2
    segments = [SYSTEM, documents[0], [8, *QUESTION]]
    with chunk_cache_llm(model_dir, **tiers(110, 0, tmp_path)) as llm:
        stats = index_of(llm).stats
        out = generate(llm, segments)
        assert stats.disk_hits == 1 and stats.misses == 1  # the system prompt
        assert_same(out, as_plain_vllm(llm, segments))
    other = {"block_size": 64}  # another fingerprint: nothing read back
    with chunk_cache_llm(model_dir, **tiers(110, 0, tmp_path), **other) as llm:
        generate(llm, segments)
        assert index_of(llm).stats.disk_hits == 0


def wait_for_files(directory: Path, count: int) -> None:
    """Until the disk tier holds ``count`` chunks (written in the background)."""
    import time

    deadline = time.monotonic() + 30
    while len(list(directory.rglob("*.json"))) < count:
        assert time.monotonic() < deadline, "the disk tier's writes did not finish"
        time.sleep(0.1)


def store_and_damage(llm, documents: list[list[int]], directory: Path) -> None:
    """Stores ``documents`` (the oldest two go to disk), then damages the
    last byte of every file the disk tier holds."""
    for document in documents:
        generate(llm, [SYSTEM, document, QUESTION])
    wait_for_files(directory, 2)
    for blob in directory.rglob("*.kv"):
        data = bytearray(blob.read_bytes())
        data[-1] ^= 0xFF
        blob.write_bytes(bytes(data))


def test_a_damaged_file_costs_a_recomputation_not_the_answer(
    model_dir, tmp_path
) -> None:
    documents = [doc(3000), doc(3100), doc(3200)]
    with chunk_cache_llm(model_dir, **tiers(110, 0, tmp_path)) as llm:
        store_and_damage(llm, documents, tmp_path)
        stats = index_of(llm).stats
        segments = [SYSTEM, documents[0], [9, *QUESTION]]
        llm.reset_prefix_cache()
        out = generate(llm, segments)
        assert stats.load_failures == 1
        assert_same(out, as_plain_vllm(llm, segments))
        again = generate(llm, segments)  # forgotten: computed and stored anew
        assert stats.load_failures == 1
        assert_same(again, out)


def test_a_chunk_whose_read_fails_under_two_requests_heals(model_dir, tmp_path) -> None:
    """Two requests plan the same chunk, whose file turns out damaged when
    the first reads it while the second waits its turn (one sequence at a
    time), still pinning it: both compute it (their answers plain vLLM's),
    and the chunk is forgotten although pinned, so a third request computes
    and stores it again and a fourth loads it, with no further failure."""
    documents = [doc(3600), doc(3700), doc(3800)]
    one_at_a_time = {"max_num_seqs": 1}
    with chunk_cache_llm(model_dir, **tiers(110, 0, tmp_path), **one_at_a_time) as llm:
        store_and_damage(llm, documents, tmp_path)
        llm.reset_prefix_cache()
        stats = index_of(llm).stats
        pair = [[SYSTEM, documents[0], [q, *QUESTION]] for q in (11, 12)]
        outs = generate_many(llm, pair)
        assert stats.load_failures == 1
        for segments, out in zip(pair, outs, strict=True):
            assert_same(out, as_plain_vllm(llm, segments))
        llm.reset_prefix_cache()
        misses = stats.misses
        third = generate(llm, [SYSTEM, documents[0], [13, *QUESTION]])
        assert stats.misses == misses + 1 and stats.load_failures == 1
        llm.reset_prefix_cache()
        hits = stats.hits
        fourth = [SYSTEM, documents[0], [14, *QUESTION]]
        out = generate(llm, fourth)
        assert stats.hits >= hits + 2 and stats.load_failures == 1
        assert_same(out, as_plain_vllm(llm, fourth))
        assert third.outputs[0].token_ids


def generate_many(llm, prompts: list[list[list[int]]]):
    """Several chunked prompts submitted together (planned before any of
    them runs a step)."""
    from vllm_kvreuse.core.request_keys import CHUNKS, seal

    inputs, params = [], []
    for segments in prompts:
        ids, lengths = chunked_prompt(segments)
        inputs.append({"prompt_token_ids": ids})
        extra_args = seal({CHUNKS: lengths})
        params.append(
            SamplingParams(
                max_tokens=6,
                temperature=0.0,
                ignore_eos=True,
                logprobs=5,
                extra_args=extra_args,
            )
        )
    return llm.generate(inputs, params, use_tqdm=False)


def test_every_tier_moves_bfloat16_chunks_unchanged(model_dir, tmp_path) -> None:
    if not (
        torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    ):
        pytest.skip("vLLM's CPU kernels run bfloat16 with AVX512-BF16 or AMX only")
    docs = [doc(1300), doc(1400), doc(1500)]
    settings = tiers(110, 70, tmp_path, size=2) | {"dtype": "bfloat16"}
    with chunk_cache_llm(model_dir, **settings) as llm:
        warm = {}
        for number, document in enumerate(docs):
            generate(llm, [SYSTEM, document, QUESTION])
            warm[number] = generate(llm, [SYSTEM, document, [7, *QUESTION]])
        assert [tier_of(llm, d) for d in docs] == ["disk", "cpu", "device"]
        for number in (0, 1):
            llm.reset_prefix_cache()
            out = generate(llm, [SYSTEM, docs[number], [7, *QUESTION]])
            assert out.outputs[0].token_ids == warm[number].outputs[0].token_ids
            assert out.outputs[0].logprobs == warm[number].outputs[0].logprobs


def test_a_full_disk_costs_the_chunks_it_could_not_take(model_dir, tmp_path) -> None:
    """The disk tier's directory turns unwritable (as a full disk does):
    chunks moved down to it are lost, counted, and computed again when
    asked for; every answer is plain vLLM's."""
    documents = [doc(3300), doc(3400), doc(3500)]
    with chunk_cache_llm(model_dir, **tiers(110, 0, tmp_path)) as llm:
        generate(llm, [SYSTEM, documents[0], QUESTION])
        (directory,) = [path for path in tmp_path.rglob("dp0") if path.is_dir()]
        directory.rmdir()
        directory.write_text("not a directory: every write fails")
        for document in documents[1:]:
            generate(llm, [SYSTEM, document, QUESTION])
        segments = [SYSTEM, documents[0], [6, *QUESTION]]
        llm.reset_prefix_cache()
        out = generate(llm, segments)
        stats = index_of(llm).stats
        assert stats.spilled >= 1 and stats.load_failures >= 1
        assert_same(out, as_plain_vllm(llm, segments))


def test_the_admin_summary_shows_the_shared_store_without_its_password(
    model_dir,
) -> None:
    """A shared store with a password, down (a closed port): requests are
    computed, and the admin endpoint's utility (what ``GET
    /v1/kvreuse/chunk_cache`` returns) names the store with ``***``."""
    url = f"redis://user:secret@127.0.0.1:{free_port()}/0"
    with chunk_cache_llm(model_dir, chunk_cache_remote_url=url) as llm:
        out = generate(llm, [SYSTEM, doc(1000), QUESTION])
        assert out.outputs[0].token_ids
        summary = llm.llm_engine.engine_core.engine_core.kvreuse_chunk_cache("stats")
        assert summary["shared_store"] == url.replace("secret", "***")
        assert "secret" not in repr(summary)
