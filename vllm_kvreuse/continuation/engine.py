"""Engine-core side of continuation: the utilities that release expired
parents and answer other API-server processes' parent look-ups.

An idle engine core blocks on its input queue, so retained KV would outlive
its TTL until the next request. The frontend's parent registry calls this
engine-core utility (``call_utility_async``) when a TTL runs out; the patch
registry installs it on ``EngineCore``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

RELEASE_EXPIRED = "kvreuse_release_expired"


def make_release_expired_utility(_: None) -> Callable[..., int]:
    def kvreuse_release_expired(self: Any) -> int:
        """Engine-core utility: release retained parents past their TTL."""
        find = getattr(self.scheduler, "feature", None)
        feature = find("continuation") if find is not None else None
        return feature.release_expired() if feature is not None else 0

    return kvreuse_release_expired


FIND_PARENT = "kvreuse_find_parent"


def make_find_parent_utility(_: None) -> Callable[..., Any]:
    def kvreuse_find_parent(self: Any, keys: list[str], cache_salt: str | None) -> Any:
        """Engine-core utility: the record of a parent this engine ran (a dict),
        ``"running"``, or None (:mod:`vllm_kvreuse.continuation.records`)."""
        find = getattr(self.scheduler, "feature", None)
        feature = find("continuation") if find is not None else None
        records = getattr(feature, "records", None)
        return records.find(keys, cache_salt) if records is not None else None

    return kvreuse_find_parent
