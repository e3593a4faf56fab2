"""The chunk store's admin actions (stats, clear, pin, unpin), run on the
scheduler side; the HTTP routes are in :mod:`.admin`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_kvreuse.chunk_cache.scheduler_side import ChunkScheduler


def run(
    side: ChunkScheduler,
    action: str,
    token_ids: list[int] | None = None,
    system_token_ids: list[int] | None = None,
    cache_salt: str | None = None,
) -> dict[str, Any]:
    """The admin endpoint's actions: stats, clear, pin, unpin.

    ``pin`` holds a stored chunk (``token_ids``, after
    ``system_token_ids`` in "system" mode, and the fill context) against
    eviction until
    ``unpin``; an admin pin is counted once however often it is asked.
    """
    index = side.index
    if action == "clear":
        return {"evicted": index.clear()}
    if action in ("pin", "unpin"):
        if not token_ids:
            raise ValueError("token_ids must list the chunk's token ids")
        key = side.key_of(
            cache_salt, side.context_of(system_token_ids or []), token_ids
        )
        entry = index.get(key)
        if entry is None or not entry.ready:
            return {"found": False}
        if action == "pin" and key not in side.admin_pins:
            side.admin_pins.add(key)
            index.pin(key)
        elif action == "unpin" and key in side.admin_pins:
            side.admin_pins.discard(key)
            index.unpin(key)
        return {"found": True, "pinned": entry.pins > 0}
    if action != "stats":
        raise ValueError(f"unknown chunk-cache action {action!r}")
    stats = side.snapshot()
    looked_up = stats["hits"] + stats["misses"]
    return {
        **stats,
        "hit_rate": stats["hits"] / looked_up if looked_up else 0.0,
        "device_capacity_bytes": index.capacity["device"],
        "cpu_capacity_bytes": index.capacity["cpu"],
    }
