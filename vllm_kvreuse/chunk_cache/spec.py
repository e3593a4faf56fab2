"""The chunk cache's declaration: its settings, request keys and class."""

from __future__ import annotations

from vllm_kvreuse.chunk_cache.engine.recompute import REQUEST_KEY as CHUNK_RECOMPUTE
from vllm_kvreuse.chunk_cache.engine.recompute import carry_recompute
from vllm_kvreuse.chunk_cache.params import BODY_FIELD, parse_lengths
from vllm_kvreuse.chunk_cache.paths.modes import MODES as CHUNK_ATTENTION_MODES
from vllm_kvreuse.chunk_cache.paths.modes import REQUEST_KEY as CHUNK_ATTENTION
from vllm_kvreuse.chunk_cache.paths.modes import parse_attention, parse_documents
from vllm_kvreuse.chunk_cache.tiers.urls import parse_store_url
from vllm_kvreuse.core.options import (
    Option,
    choice_parser,
    parse_bool,
    parse_count,
    parse_directory,
    parse_fraction,
    parse_gib,
    parse_gib_or_auto,
    parse_key_file,
    parse_margin,
    parse_separator,
    parse_tokens,
)
from vllm_kvreuse.core.request_keys import CHUNKS, DOCUMENTS
from vllm_kvreuse.core.spec import ArgKey, FeatureSpec

CHUNK_HASHES = ("", "sha256", "sha256_cbor", "xxhash", "xxhash_cbor")

SPEC = FeatureSpec(
    name="chunk_cache",
    options=(
        Option(
            "enable_chunk_cache",
            parse_bool,
            False,
            "Position-independent chunk cache for RAG requests that send their "
            "segments as a 'chunks' field (texts or token-id lists: system prompt, "
            "documents, question), or chat requests with 'chunk_messages': true "
            "(every message before the last a chunk, through the model's chat "
            "template): a chunk not yet stored is computed in place (as plain "
            "vLLM computes it) and stored by content; a stored chunk is reused at "
            "any position by re-rotating its keys. Ordinary prompts are never "
            "chunked. Uses the KV-connector slot.",
        ),
        Option(
            "chunk_separator",
            parse_separator,
            "",
            "Also split text prompts, and chat conversations as the chat template "
            "renders them, at this separator into chunks (e.g. '##', the format "
            "'sys##doc1##doc2##question'); every prompt containing it is then "
            "chunked. Empty (the default): only requests with a 'chunks' field "
            "or 'chunk_messages' are chunked.",
        ),
        Option(
            "chunk_cache_device_fraction",
            parse_fraction,
            0.1,
            "Chunk-store capacity on the KV cache's device, as a fraction of the "
            "KV cache's size (memory on top of it).",
        ),
        Option(
            "chunk_cache_cpu_gib",
            parse_gib_or_auto,
            "auto",
            "Chunk-store capacity in host memory (GiB), for chunks moved down "
            "from the device tier. 'auto' (the default): a tenth of this machine's "
            "memory, at least 1 GiB and at most 64 GiB; each server on a machine "
            "takes its own share, so give several servers a size each. 0 turns "
            "the CPU tier off.",
        ),
        Option(
            "chunk_cache_disk_path",
            parse_directory,
            "",
            "A directory for the disk tier: chunks moved down from the CPU tier "
            "are written there and outlive the server (a restart reads back the "
            "chunks of the same model, dtype, block size and parallel layout). "
            "Empty (the default): no disk tier.",
        ),
        Option(
            "chunk_cache_disk_gib",
            parse_gib,
            32.0,
            "Disk-tier capacity in GiB (with --chunk-cache-disk-path).",
        ),
        Option(
            "chunk_cache_remote_url",
            parse_store_url,
            "",
            "A Valkey or Redis server several servers share as a chunk tier "
            "(valkey://host:port, redis://[user:password@]host:port/db, "
            "unix:///path): every chunk one server stores is written there, "
            "and a chunk none of a server's own tiers holds is loaded from "
            "there. The server's maxmemory and eviction policy size it. Needs "
            "the valkey client library (pip install valkey); a password in it "
            "is shown as *** in logs and endpoints. Empty (the default): none.",
        ),
        Option(
            "chunk_cache_store_key_file",
            parse_key_file,
            "",
            "A file holding a secret (at least 16 bytes) shared by the servers of "
            "one disk tier or shared store: every stored chunk is sealed with an "
            "HMAC-SHA256 under it and checked on read, so nobody without the key "
            "can write KV a server loads. Empty (the default): a checksum only, "
            "and the store must be private to the servers (docs/chunk_cache.md).",
        ),
        Option(
            "chunk_cache_hash",
            choice_parser(*CHUNK_HASHES),
            "",
            "Hash of chunk content keys; empty (default) uses vLLM's "
            "--prefix-caching-hash-algo (sha256 unless set).",
        ),
        Option(
            "chunk_attention",
            choice_parser(*CHUNK_ATTENTION_MODES),
            "joint",
            "How a chunked request with several documents is answered: 'joint' "
            "(one prompt: stored chunks loaded, new ones computed in place) or "
            "'paths' (each document on its own prefix, system prompt + document "
            "+ question, and the request answered on the one that makes the "
            "question likeliest; exact KV, no cross-document answers) or "
            "'choose' (the documents scored as in 'paths', those within "
            "--chunk-choose-margin of the best kept, at most --chunk-choose-k, "
            "and the request answered on them jointly with exact attention). A "
            "request's 'chunk_attention' field overrides it.",
        ),
        Option(
            "chunk_choose_margin",
            parse_margin,
            1.0,
            "With chunk_attention 'choose': keep every document whose path "
            "scores within this many nats per question token of the best "
            "path's (mean log-probability of the tokens after the document).",
        ),
        Option(
            "chunk_choose_k",
            parse_tokens,
            2,
            "With chunk_attention 'choose': keep at most this many documents "
            "(the likeliest; 0 or 1: one, as 'paths').",
        ),
        Option(
            "chunk_paths_max_documents",
            parse_count,
            16,
            "With chunk_attention 'paths' or 'choose': a request with more "
            "documents than this runs 'joint' instead (its response says so), "
            "since each document costs one scoring request (a prefill of its "
            "path and a slot in the running batch) before the answer starts. "
            "The default covers the usual 3 to 10 retrieved documents with "
            "room; 0: no cap.",
        ),
        Option(
            "chunk_recompute_fraction",
            parse_fraction,
            0.125,
            "Share of a chunked prompt's chunk tokens, taken from the end of its "
            "last chunk backwards, that is recomputed with full attention with the "
            "question instead of loaded from the store (1: full attention). The "
            "default, with --chunk-recompute-head 64, keeps the most answers at a "
            "warm TTFT >= 3x below plain vLLM (docs/results/chunk_cache.md).",
        ),
        Option(
            "chunk_recompute_head",
            parse_tokens,
            64,
            "Tokens at the start of every chunk but the first that are recomputed "
            "with the real preceding context instead of loaded (EPIC); each "
            "recomputed run costs the request one engine step.",
        ),
        Option(
            "chunk_recompute_select",
            parse_fraction,
            0.0,
            "Share of a chunked prompt's chunk tokens recomputed with full "
            "attention, spent on the chunks most relevant to the question "
            "(tf-idf of its tokens), each from its start (0: off).",
        ),
    ),
    keys=(
        ArgKey(
            DOCUMENTS,
            "chunk_cache",
            False,
            parse_documents,
            "Which chunks of a chunked prompt are documents (candidates of "
            "answer paths): a chat conversation's turns are not.",
        ),
        ArgKey(
            CHUNK_ATTENTION,
            "chunk_cache",
            True,
            parse_attention,
            "How a chunked request is answered: 'joint', 'paths' or 'choose' "
            "(else the server's --chunk-attention).",
        ),
        ArgKey(
            CHUNK_RECOMPUTE,
            "chunk_cache",
            True,
            carry_recompute,
            "Which chunk tokens a chunked request recomputes (else the server's).",
        ),
        ArgKey(
            CHUNKS,
            "chunk_cache",
            False,
            parse_lengths,
            "Token lengths of a chunked prompt's chunks (a continuation child "
            "keeps its parent's, so it is hashed as its parent was).",
            inherited=True,
        ),
    ),
    switch="enable_chunk_cache",
    feature="vllm_kvreuse.chunk_cache.feature:ChunkCache",
    attach_engine_args="vllm_kvreuse.chunk_cache.engine_args:attach_chunk_connector",
    on_register="vllm_kvreuse.chunk_cache.engine_args:register_chunk_connector_name",
    promptless_fields=(BODY_FIELD,),
    render_completion="vllm_kvreuse.chunk_cache.frontend.segments:render_chunked",
    render_chat="vllm_kvreuse.chunk_cache.frontend.chat:render_chunked_chat",
)
