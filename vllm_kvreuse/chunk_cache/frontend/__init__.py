"""The chunk cache in the API server (and ``LLM``): chunked prompts in
(what they carry in ``extra_args``: :mod:`vllm_kvreuse.chunk_cache.params`).

- ``segments.py``: prompts split into segments, the ``chunks`` field;
- ``chat.py``: chunked chat completions (``chunk_messages``, the separator,
  ``documents``) through the model's chat template;
- ``chat_split.py``: where a rendered chat is cut, and the check that its
  pieces' tokens are vLLM's;
- ``admin.py``: the admin endpoint, as a vLLM endpoint plugin.
"""

from vllm_kvreuse.chunk_cache.frontend.segments import chunked_request

__all__ = ["chunked_request"]
