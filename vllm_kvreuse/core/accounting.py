"""The block-accounting invariant: every reference on a block is owned.

Between steps, for every block of the pool but the null block:

    ref_cnt == (live requests whose block table holds it)
             + (ledger entries holding it)
             + (deferred frees waiting for an in-flight step)
             + (copy-on-write endpoints upstream queued for the next step's
                copies, which its ``schedule()`` drains)

and the free queue holds exactly the blocks whose count is zero. So free +
held + live covers the pool, and nothing is held by nobody (a leak) or freed
while still referenced. Tests check it after every unit and integration
test (:func:`check_block_accounting`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from vllm_kvreuse.core.upstream.scheduler import Upstream, referenced_blocks


def expected_references(scheduler: Any) -> Counter[int]:
    """Block id -> references the scheduler's owners account for."""
    refs: Counter[int] = Counter(
        b.block_id for b in referenced_blocks(scheduler) if not b.is_null
    )
    layer = getattr(scheduler, "kvreuse", None)
    if layer is not None:
        refs.update(b.block_id for b in layer.ledger.held_blocks())
    return refs


def check_block_accounting(scheduler: Any) -> None:
    """Raises ``AssertionError`` naming every block whose count is not owned."""
    upstream = Upstream(scheduler)
    blocks = upstream.pool_blocks()
    refs = expected_references(scheduler)
    wrong = [
        f"block {b.block_id}: ref_cnt {b.ref_cnt}, owned {refs.get(b.block_id, 0)}"
        for b in blocks
        if not b.is_null and b.ref_cnt != refs.get(b.block_id, 0)
    ]
    assert not wrong, "unowned or over-freed KV block references:\n" + "\n".join(
        wrong[:20]
    )
    num_free = sum(1 for b in blocks if not b.is_null and b.ref_cnt == 0)
    in_queue = upstream.num_free_blocks()
    assert in_queue == num_free, (
        f"free queue has {in_queue} blocks, {num_free} have no reference"
    )
