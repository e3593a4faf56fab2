"""A stand-in model for scheduler-level tests: tokens and beam steps.

Tests only. Scheduler tests run a real scheduler without an engine; this
module plays the model runner's part for a step: each request that
samples draws a fixed token, and each beam group the step names
(:mod:`vllm_kvreuse.beam.plan`) runs through the real worker code
(:class:`~vllm_kvreuse.beam.worker.job.BeamJob`, its live groups kept per
scheduler as a runner keeps them; no KV, so nothing is copied) on made-up
logits that depend only on the request's last known token, so beams
diverge and EOS can win.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from vllm.v1.outputs import ModelRunnerOutput

from vllm_kvreuse.beam.plan import put_results, steps_of
from vllm_kvreuse.beam.worker.job import BeamJob
from vllm_kvreuse.beam.worker.state import GroupState

_STATES: weakref.WeakKeyDictionary[Any, dict[str, GroupState]] = (
    weakref.WeakKeyDictionary()
)
"""Each scheduler's stand-in worker's live groups (the runner keeps them)."""
_LAST: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()
"""Each scheduler's stand-in worker's last sample per request, the next
step's input as a runner keeps it (a request stepped outside upstream's
loop has no token appended scheduler-side: a beam group stepped as one)."""


def made_up_logits(
    last_token: int, vocab: int, variant: int = 0, eos: int | None = None
) -> torch.Tensor:
    """One row: coarse values (ties), shifted by the last token; EOS on top
    when ``eos`` is given."""
    tokens = torch.arange(vocab)
    row = -(((tokens * 7 + last_token * 3 + variant) % 11).float()) / 2
    if eos is not None:
        row[eos] = 1.0
    return row


def model_output(
    scheduler: Any,
    output: Any,
    sampling: set[str],
    token: int,
    variant: int = 0,
    eos: int | None = None,
    logprobs: Callable[[list[str]], Any] | None = None,
) -> ModelRunnerOutput:
    """What a model run of ``output`` returns: ``token`` for each request in
    ``sampling`` (none for a partial prefill), its beam groups' steps run
    next to made-up logits (their members' tokens are the chosen ones), and
    ``logprobs(req_ids)`` as the log-prob lists if given."""
    req_ids = list(output.num_scheduled_tokens)
    index = {rid: i for i, rid in enumerate(req_ids)}
    sampled = torch.full((len(req_ids),), token, dtype=torch.int64)
    vocab = scheduler.vllm_config.model_config.get_vocab_size()
    rows = torch.zeros(len(req_ids), vocab)
    kept = _LAST.setdefault(scheduler, {})
    cached = output.scheduled_cached_reqs
    running = set(cached.req_ids) - set(cached.resumed_req_ids)
    for rid, i in index.items():
        request = scheduler.requests.get(rid)
        last = request.all_token_ids[-1] if request is not None else 0
        if rid in running and rid in kept:  # the runner's own last sample
            last = kept[rid]
        rows[i] = made_up_logits(int(last), vocab, variant, eos)
    results: dict[str, Any] = {}
    steps = steps_of(output)
    if steps:
        states = _STATES.setdefault(scheduler, {})
        job = BeamJob(steps, states, lambda: _catalog(scheduler), index)
        job.prepare(rows)
        job.finish(sampled)
        results = job.results
    kept.update((rid, int(sampled[i])) for rid, i in index.items() if rid in sampling)
    out = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index=index,
        sampled_token_ids=[
            [int(sampled[i])] if rid in sampling else [] for rid, i in index.items()
        ],
        logprobs=logprobs(req_ids) if logprobs is not None else None,
    )
    if steps:
        put_results(out, results)
    return out


def _catalog(scheduler: Any) -> Any:
    from vllm_kvreuse.beam.catalog.load import engine_catalog

    return engine_catalog(scheduler.vllm_config, "cpu")
