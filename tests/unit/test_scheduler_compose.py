"""The feature mixins share one class: a helper of one must never shadow
another's by name (only upstream hooks may be defined by several)."""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler

from vllm_kvreuse.scheduler import SCHEDULER_MIXINS

# Hooks one mixin offers for another to override, by design:
PLUGIN_HOOKS = {
    "num_cache_hit_tokens",  # the threshold's hit count; the chunk cache adds
    "_parent_entry",  # continuation's parent lookup; beam search adds held beams
}


def test_mixins_define_no_clashing_helpers() -> None:
    owners: dict[str, str] = {}
    clashes = []
    for mixin in SCHEDULER_MIXINS:
        for name in vars(mixin):
            if (
                name.startswith("__")
                or hasattr(Scheduler, name)
                or (name in PLUGIN_HOOKS)
            ):
                continue  # dunders and upstream hooks chain through super()
            if name in owners:
                clashes.append(f"{name}: {owners[name]} and {mixin.__name__}")
            owners[name] = mixin.__name__
    assert clashes == []
