"""Helpers for tests and benchmarks; never imported by the serving path.

- ``tiny_model.py``: a random-weight Qwen2 model and a trained tokenizer;
- ``smollm2.py``: the default served model, SmolLM2-135M-Instruct;
- ``server.py``: a real ``vllm serve`` process on a free loopback port;
- ``server_group.py``: several of them started together, ready together;
- ``router.py``: a real ``vllm-router`` in front of test servers;
- ``valkey.py``: a real Valkey server, the chunk cache's shared store;
- ``service.py``: what those share: a loopback HTTP program, its log,
  its readiness, its stop;
- ``processes.py``: HTTP connections pinned to one API-server process;
- ``kv_caches.py``: per-layer KV caches from vLLM's own allocator;
- ``ascend_layout.py``: vllm-ascend's per-layer KV cache, on any device;
- ``reference.py``: the chunk cache's references: masks and segmented KV;
- ``catalog_reference.py``: the dense catalog-constrained beam step;
- ``beam_reference.py``: one beam step by brute force over whole rows;
- ``beam_outputs.py``: a beam search's root output as the engine sends it;
- ``row_passes.py``: the operations that pass over whole logits rows, and
  their bytes;
- ``fake_worker.py``: a stand-in model runner for scheduler-level tests
  (tokens, and beam steps through the real worker code);
- ``soak/``: a bounded mixed-load run against a live server.
"""
