"""A bounded mixed-load run ("soak") against a live server with every feature on.

Shared by ``tests/e2e/test_soak.py`` (about a minute) and
``benchmarks/soak.py`` (ten minutes, results in ``docs/soak.md``):

- :mod:`.corpus`: the texts (plain prompts, a document pool, RAG prompts);
- :mod:`.mix`: the client, a seeded mix of every kind of request;
- :mod:`.monitor`: samples /metrics, /health and the server's memory;
- :mod:`.run`: the load, then the drain and the probes;
- :mod:`.records`: one line per HTTP request, and what it expected;
- :mod:`.report`: the summary and its markdown.
"""
