"""Admin endpoint of the chunk store, as a vLLM endpoint plugin.

Routes (all JSON):
- ``GET /v1/kvreuse/chunk_cache``: chunks, hits, misses, hit rate, tokens,
  evictions, bytes and capacity per tier, pinned chunks;
- ``POST /v1/kvreuse/chunk_cache/clear``: evicts every unpinned chunk;
- ``POST /v1/kvreuse/chunk_cache/pin`` and ``/unpin`` with ``{"token_ids":
  [...], "cache_salt": ...}``: hold a stored
  chunk against eviction, or let it go.

vLLM loads endpoint plugins only when named in ``VLLM_PLUGINS``; this one
and the general plugin are both named ``kvreuse``, so
``VLLM_PLUGINS=kvreuse`` loads both. The engine side is the engine-core
utility in :mod:`vllm_kvreuse.chunk_cache.engine.admin`, installed by the general
plugin (:mod:`vllm_kvreuse.patches`).
"""

from __future__ import annotations

from argparse import Namespace
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.datastructures import State

from vllm_kvreuse.chunk_cache.engine.admin import UTILITY

router = APIRouter(prefix="/v1/kvreuse/chunk_cache")


class ChunkRef(BaseModel):
    token_ids: list[int]
    cache_salt: str | None = None


async def _call(request: Request, action: str, ref: ChunkRef | None = None) -> Any:
    """Calls every engine core (each DP rank has its own store); with one,
    its answer, with several ``{"data_parallel_ranks": [answer per rank]}``."""
    engine_core = request.app.state.kvreuse_engine_client.engine_core
    args = (ref.model_dump(),) if ref else ()
    try:
        results = await engine_core.call_utility_all_async(UTILITY, action, *args)
        result = results[0] if len(results) == 1 else {"data_parallel_ranks": results}
    except Exception as e:  # the engine's ValueError comes back as an error
        return JSONResponse(
            {"error": {"message": str(e), "type": "BadRequestError", "code": 400}},
            status_code=HTTPStatus.BAD_REQUEST,
        )
    return JSONResponse(result)


@router.get("")
async def stats(request: Request) -> Any:
    return await _call(request, "stats")


@router.post("/clear")
async def clear(request: Request) -> Any:
    return await _call(request, "clear")


@router.post("/pin")
async def pin(request: Request, ref: ChunkRef) -> Any:
    return await _call(request, "pin", ref)


@router.post("/unpin")
async def unpin(request: Request, ref: ChunkRef) -> Any:
    return await _call(request, "unpin", ref)


class ChunkCacheAdmin:
    """The ``vllm.endpoint_plugins`` entry point's plugin object."""

    name = "kvreuse"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(router)

    async def init_state(
        self, engine_client: Any, state: State, args: Namespace
    ) -> None:
        state.kvreuse_engine_client = engine_client
