"""Reference: one catalog-constrained beam step on full-vocabulary log-probs.

Not on the serving path. The engine masks each catalog beam's logits in the
worker (:mod:`vllm_kvreuse.beam.catalog.processor`) and steps on the sparse
top-k rows that come back (:mod:`vllm_kvreuse.beam.catalog.rule`). This
module states the same rule densely, on a ``[B, vocab]`` log-prob matrix;
tests check it against a brute-force search and check the engine against
it, and ``benchmarks/sid_catalog_micro.py`` times it.

The rule is :func:`vllm_kvreuse.beam.rule.expand`'s, restricted to the
catalog, with the mask applied *before* the top-k:

1. Each beam's legal tokens are its trie node's children
   (:meth:`SidCatalog.legal`); at a leaf (a complete item) the only legal
   token is EOS, if the request has one and does not ignore it.
2. Each beam offers the ``2 * width`` best legal tokens of its full
   vocabulary log-prob row, best first, ties to the lower token id. Tokens
   the model gives -inf are not offered. Log-probs are not renormalised
   over the legal tokens: a returned item's ``cum_logprob`` is its
   log-probability under the model.
3. As in ``expand``: EOS completes a beam; the other candidates, listed beam
   by beam in offer order, are ranked by cumulative log-prob in
   :func:`~vllm_kvreuse.beam.rule.rank`'s order, and the best ``width``
   live on.

Fewer children than ``width`` (the documented rule): the best ``width``
candidates are taken over all beams' legal children together, so a beam
whose node has few children leaves room to its siblings' children; only
when all live beams together have fewer than ``width`` legal candidates does
the step return fewer beams. A beam with no legal candidate ends: at a leaf
(no EOS to take: ``eos_token_id`` unset, ``ignore_eos``, or EOS at -inf) it
completes as it is, with finish reason "length", since it holds a whole
item; elsewhere (all its children at -inf) it is dropped.

:func:`step` works on tensors and returns arrays; it is :func:`offers`
(steps 1-2, on the log-probs' device, ``[B, 2 * width]`` out) then
:func:`select` (step 3, numpy), which can run in different processes.
:func:`expand_constrained` wraps it in the policy's ``Beam``/``Step``
objects for the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from vllm.entrypoints.generate.beam_search.utils import BeamSearchSequence

from vllm_kvreuse.beam.catalog.trie import SidCatalog
from vllm_kvreuse.beam.rule import Beam, BeamConfig, Step, rank

NO_TOKEN = -1
"""``CatalogStep.completed_tokens`` of a beam that ended at a leaf without EOS."""


@dataclass(frozen=True, slots=True)
class Offers:
    """Each beam's offered candidates, ``[B, k]``, best first; unused: -inf/-1."""

    logprobs: np.ndarray  # float32
    tokens: np.ndarray  # int64
    nodes: np.ndarray  # int64 child node; -1 for EOS and unused slots


@dataclass(frozen=True, slots=True)
class CatalogStep:
    """Result of one step. Live beams best first; completed in offer order."""

    parents: np.ndarray  # [K] int64: index of the parent beam in the input
    tokens: np.ndarray  # [K] int64
    cum_logprobs: np.ndarray  # [K] float64
    nodes: np.ndarray  # [K] int64: trie node after the token
    completed_parents: np.ndarray  # [C] int64
    completed_tokens: np.ndarray  # [C] int64: EOS, or NO_TOKEN
    completed_cum_logprobs: np.ndarray  # [C] float64


def offers(
    catalog: SidCatalog,
    logprobs: torch.Tensor,
    nodes: torch.Tensor,
    config: BeamConfig,
) -> Offers:
    """Each beam's best ``2 * width`` legal candidates (steps 1-2 of the rule).

    ``logprobs``: ``[B, vocab_size]`` log-probs of each beam's next token, on
    the catalog's device. ``nodes``: ``[B]`` each beam's trie node.
    """
    assert logprobs.ndim == 2 and logprobs.shape[1] == catalog.vocab_size, (
        f"expected [beams, {catalog.vocab_size}] log-probs, got "
        f"{tuple(logprobs.shape)}: rows must cover the whole vocabulary"
    )
    nodes = torch.as_tensor(nodes, device=catalog.device).long().reshape(-1)
    tokens, children = catalog.legal(nodes)
    eos = config.eos_token_id
    if eos is not None and not config.ignore_eos:
        assert 0 <= eos < catalog.vocab_size, f"EOS {eos} outside the vocabulary"
        # One more column, used by leaves only (their rows are otherwise
        # empty, so EOS is their only candidate).
        leaf_eos = torch.where(catalog.is_leaf(nodes), eos, -1)
        tokens = torch.cat([tokens, leaf_eos[:, None]], dim=1)
        children = torch.cat([children, torch.full_like(leaf_eos, -1)[:, None]], 1)
    values = logprobs.gather(1, tokens.clamp(min=0)).float()
    values = values.masked_fill_(tokens < 0, float("-inf"))
    best = top_k_stable(values, min(2 * config.width, values.shape[1]))
    return Offers(
        logprobs=values.gather(1, best).cpu().numpy(),
        tokens=tokens.gather(1, best).cpu().numpy(),
        nodes=children.gather(1, best).cpu().numpy(),
    )


def step(
    catalog: SidCatalog,
    logprobs: torch.Tensor,
    cum_logprobs: Sequence[float] | np.ndarray,
    nodes: torch.Tensor,
    config: BeamConfig,
) -> CatalogStep:
    """One constrained step (the module's rule), vectorised over beams:
    :func:`offers` where the log-probs are, then :func:`select` on the CPU.

    ``cum_logprobs``: ``[B]`` the beams' cumulative log-probs (float64, as
    the policy's Python floats). Reads its inputs, mutates nothing.
    """
    nodes = torch.as_tensor(nodes, device=catalog.device).long().reshape(-1)
    offered = offers(catalog, logprobs, nodes, config)
    return select(offered, cum_logprobs, catalog.is_leaf(nodes).cpu().numpy(), config)


def select(
    offered: Offers,
    cum_logprobs: Sequence[float] | np.ndarray,
    leaf: np.ndarray,
    config: BeamConfig,
) -> CatalogStep:
    """Step 3 of the rule on the beams' offers; numpy only, no catalog.

    ``leaf``: ``[B]`` bool, the beam's node is a leaf
    (:meth:`SidCatalog.is_leaf`). The scheduler can run this on offers a
    worker computed next to the logits.
    """
    num_beams, k = offered.tokens.shape
    cum = np.asarray(cum_logprobs, dtype=np.float64).reshape(num_beams)
    # Candidates beam by beam, in offer order: the order ``expand`` lists them.
    parents = np.repeat(np.arange(num_beams), k)
    values, tokens, children = (
        a.reshape(-1) for a in (offered.logprobs, offered.tokens, offered.nodes)
    )
    keep = values > -np.inf
    parents, values, tokens, children = (
        a[keep] for a in (parents, values, tokens, children)
    )
    # The same float64 sum as the policy's ``beam.seq.cum_logprob + logprob``.
    scores = cum[parents] + values.astype(np.float64)
    is_eos = children < 0  # only EOS candidates lead to no node
    # A leaf with nothing to offer (no EOS to take, or EOS at -inf) holds a
    # whole item: it completes as it is rather than vanish.
    offering = np.bincount(parents, minlength=num_beams) > 0
    stuck = np.flatnonzero(np.asarray(leaf, dtype=bool) & ~offering)
    done_parents = np.concatenate([parents[is_eos], stuck])
    done_tokens = np.concatenate([tokens[is_eos], np.full(len(stuck), NO_TOKEN)])
    done_scores = np.concatenate([scores[is_eos], cum[stuck]])
    done = np.argsort(done_parents, kind="stable")  # beam order, as ``expand``
    live = np.flatnonzero(~is_eos)
    order = live[rank(scores[live], parents[live], tokens[live], config.width)]
    return CatalogStep(
        parents=parents[order],
        tokens=tokens[order],
        cum_logprobs=scores[order],
        nodes=children[order],
        completed_parents=done_parents[done],
        completed_tokens=done_tokens[done],
        completed_cum_logprobs=done_scores[done],
    )


def top_k_stable(values: torch.Tensor, k: int) -> torch.Tensor:
    """``[B, k]`` column indices of each row's ``k`` largest values.

    Best first; equal values in column order. The same as a stable
    descending sort cut to ``k``, without sorting whole rows (a row at the
    root spans a whole codebook). NaN counts as -inf.
    """
    values = values.masked_fill(values.isnan(), float("-inf"))
    if k == 0 or 4 * k >= values.shape[1]:  # most of the row: sort it all
        return values.sort(dim=1, descending=True, stable=True).indices[:, :k]
    kth = values.topk(k, dim=1).values[:, -1:]  # the k-th largest value
    above = values > kth
    equal = values == kth
    # All values above the k-th, then the first equal ones in column order:
    # exactly k per row, so the nonzero columns reshape to [B, k].
    needed = k - above.sum(dim=1, keepdim=True)
    take = above | (equal & (equal.cumsum(dim=1) <= needed))
    columns = take.nonzero()[:, 1].reshape(len(values), k)
    best = values.gather(1, columns).sort(dim=1, descending=True, stable=True)
    return columns.gather(1, best.indices)


def offer_rows(
    catalog: SidCatalog, logprobs: torch.Tensor, nodes: torch.Tensor, config: BeamConfig
) -> list[dict[int, float]]:
    """Rows for :func:`~vllm_kvreuse.beam.rule.expand`: ``expand`` on them
    selects what :func:`step` selects (tokens, scores, parents, order)."""
    offered = offers(catalog, logprobs, nodes, config)
    return [
        {t: v for t, v in zip(tokens, values, strict=True) if v > -np.inf}
        for tokens, values in zip(
            offered.tokens.tolist(), offered.logprobs.tolist(), strict=True
        )
    ]


@dataclass(slots=True)
class CatalogExpansion:
    """``expand``'s result plus the trie node of each next beam."""

    step: Step
    nodes: list[int]  # aligned with step.beams


def expand_constrained(
    beams: Sequence[Beam],
    nodes: Sequence[int] | torch.Tensor,
    logprobs: torch.Tensor,
    catalog: SidCatalog,
    config: BeamConfig,
) -> CatalogExpansion:
    """:func:`~vllm_kvreuse.beam.rule.expand` restricted to the catalog.

    ``nodes[i]``: trie node of ``beams[i]`` (0, the root, at the first step);
    ``logprobs``: ``[len(beams), vocab_size]``, row ``i`` for ``beams[i]``.
    Builds sequences exactly as ``expand`` does; a beam that completes at a
    leaf without EOS gets finish reason "length".
    """
    cums = [beam.seq.cum_logprob for beam in beams]
    result = step(catalog, logprobs, cums, torch.as_tensor(nodes), config)
    out = Step()
    for index, token, cum in zip(
        result.completed_parents.tolist(),
        result.completed_tokens.tolist(),
        result.completed_cum_logprobs.tolist(),
        strict=True,
    ):
        parent = beams[index].seq
        ended_by_eos = token != NO_TOKEN
        keep_token = ended_by_eos and config.include_stop_str_in_output
        done = BeamSearchSequence(
            orig_prompt=parent.orig_prompt,
            tokens=[*parent.tokens, token] if keep_token else parent.tokens,
            logprobs=[], cum_logprob=cum,
            finish_reason="stop" if ended_by_eos else "length",
            stop_reason=token if ended_by_eos else None,
        )  # fmt: skip
        out.completed.append(done)
    for index, token, cum in zip(
        result.parents.tolist(),
        result.tokens.tolist(),
        result.cum_logprobs.tolist(),
        strict=True,
    ):
        parent = beams[index]
        seq = BeamSearchSequence(
            orig_prompt=parent.seq.orig_prompt, tokens=[*parent.seq.tokens, token],
            logprobs=[], cum_logprob=cum,
        )  # fmt: skip
        out.beams.append((seq, parent.request_id))
    return CatalogExpansion(out, result.nodes.tolist())
