"""Engine beam search's counters in ``/metrics``."""

from __future__ import annotations

from vllm_kvreuse.metrics import counter


def count_beam_group(
    num_forks: int,
    num_copied_blocks: int,
    num_member_computed_tokens: int,
    num_steps_as_one: int = 0,
) -> None:
    counter("beam_groups", "Beam searches run inside the engine.").inc()
    counter(
        "beam_forks",
        "Beams put on a parent beam's KV: new member requests, and live "
        "members that took another beam's KV (engine beam search).",
    ).inc(num_forks)
    counter(
        "beam_copied_blocks",
        "KV blocks copied when forking beams: members' copy-on-write tails, "
        "and a moved member's private blocks (engine beam search).",
    ).inc(num_copied_blocks)
    counter(
        "beam_computed_prompt_tokens",
        "Prompt tokens computed by beam requests inside the engine (beyond the "
        "root request, which vLLM's prompt-token metrics count); their outputs "
        "never reach the frontend, so vLLM's metrics do not see them.",
    ).inc(num_member_computed_tokens)
    counter(
        "beam_steps_as_one",
        "Beam steps a group ran as one request: its members out of vLLM's "
        "scheduling loop, the step added whole (engine beam search).",
    ).inc(num_steps_as_one)
