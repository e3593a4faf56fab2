"""The ``extra_args`` keys read outside the package that writes them.

Features never import each other and core imports no feature, so a key that
crosses that line is defined here, once, and imported by every reader. A key
only its own feature reads stays in that feature (``kvreuse_beam`` is
:data:`vllm_kvreuse.beam.policy.CONFIG_KEY`). Owners, visibility and
validators of every key: :mod:`vllm_kvreuse.request_args`.
"""

from __future__ import annotations

PREFIX = "kvreuse_"
"""Keys starting with it are reserved: unknown ones are refused too."""

PARENT = "kvreuse_parent"
"""Internal: the engine request id whose held KV blocks this request may
inherit (continuation children, beam members). Read by the core layer."""

SEAL = "kvreuse_sealed"
"""Internal: the plugin's per-process seal on ``extra_args`` it wrote."""

CHUNKS = "kvreuse_chunks"
"""Internal: a chunked prompt's chunk token lengths. Written and read by the
chunk cache; continuation reads it too, so that a chunked parent's children
are chunked the same way."""
