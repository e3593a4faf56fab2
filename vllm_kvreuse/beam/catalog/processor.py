"""The SID catalog's mask, as a vLLM logits processor in the workers.

Catalog-constrained beams (``--sid-catalog``) must see, for each beam, the
best ``2 * width`` tokens *among its trie node's children*, with their true
log-probabilities (masked before the top-k, not renormalised). vLLM returns
a request's top-k log-probs of the whole vocabulary; with this processor and
``--logprobs-mode processed_logprobs`` it returns exactly the wanted ones:

- rows of requests that carry a trie node (``extra_args["kvreuse_sid_node"]``,
  set by the engine's beam search on the root and every member) keep their
  node's children's logits and get -inf everywhere else,
- except one *sink* token (the smallest token id that is not a child), which
  gets the log-sum-exp of every masked logit. The row's normaliser is then
  unchanged, so the processed log-prob of each child is its raw log-prob;
  the sink, never a catalog token, is dropped by the beam step.

Loaded through vLLM's ``logits_processors`` setting (added by
``--sid-catalog``); rows without a node are untouched and a batch without
any costs one dict truth test. vLLM's two model runners have two processor
interfaces: :class:`CatalogLogitsProcessor` for the V1 runner (batch updates
keyed by persistent-batch row), :class:`CatalogLogitsProcessorV2` for the V2
runner (per-slot state, rows mapped to slots each step). Both mask through
:func:`mask_catalog_rows`; ``load.select_catalog_processor`` names
the one the engine's runner loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates
from vllm.v1.worker.gpu.sample.logits_processor import (
    LogitsContext,
    LogitsProcRequestState,
)
from vllm.v1.worker.gpu.sample.logits_processor import (
    LogitsProcessor as LogitsProcessorV2,
)

from vllm_kvreuse.beam.catalog.load import engine_catalog
from vllm_kvreuse.beam.catalog.trie import SidCatalog
from vllm_kvreuse.core.request_keys import SID_EOS, SID_NODE

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.sampling_params import SamplingParams


class CatalogLogitsProcessor(LogitsProcessor):
    """Masks catalog beams' rows to their trie node's children (plus a sink)."""

    def __init__(
        self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool
    ) -> None:
        self.catalog = engine_catalog(vllm_config, device)
        # batch row -> (trie node, token allowed at a leaf or -1)
        self.nodes: dict[int, tuple[int, int]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # masking changes the argmax

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.nodes, batch_update, self._node_of)

    @staticmethod
    def _node_of(
        params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> tuple[int, int] | None:
        return catalog_state(params)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.nodes or self.catalog is None:
            return logits
        rows = torch.tensor(list(self.nodes), device=logits.device)
        states = torch.tensor(list(self.nodes.values()))
        return mask_catalog_rows(self.catalog, logits, rows, states[:, 0], states[:, 1])


class CatalogLogitsProcessorV2(LogitsProcessorV2):
    """The same mask for the V2 model runner.

    State is per request slot (``add_request`` overwrites a recycled slot's
    state; ``-1`` means "not a catalog beam"); each step maps the logits rows
    to slots on the host, so a batch without catalog beams costs one numpy
    lookup and no device work.
    """

    def __init__(
        self, vllm_config: VllmConfig, req_states: LogitsProcRequestState
    ) -> None:
        self.catalog = engine_catalog(vllm_config, req_states.device)
        self.node = np.full(req_states.max_num_reqs, -1, dtype=np.int64)
        self.leaf_eos = np.full(req_states.max_num_reqs, -1, dtype=np.int64)

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        state = catalog_state(sampling_params)
        self.node[req_idx], self.leaf_eos[req_idx] = state or (-1, -1)
        return state is not None and self.catalog is not None

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        if self.catalog is None:
            return logits
        # One logits row per request unless speculative decoding expands rows.
        slots = (
            ctx.idx_mapping_np
            if logits.shape[0] == len(ctx.idx_mapping_np)
            else ctx.expanded_idx_mapping.cpu().numpy()
        )
        nodes = self.node[slots]
        (rows,) = np.nonzero(nodes >= 0)
        if not len(rows):
            return logits
        return mask_catalog_rows(
            self.catalog,
            logits,
            torch.from_numpy(rows).to(logits.device),
            torch.from_numpy(nodes[rows]),
            torch.from_numpy(self.leaf_eos[slots[rows]]),
        )


def catalog_state(params: SamplingParams) -> tuple[int, int] | None:
    """A catalog beam's (trie node, token allowed at a leaf or -1); None for
    any other request."""
    extra_args = params.extra_args
    if not extra_args or extra_args.get(SID_NODE) is None:
        return None
    leaf_eos = extra_args.get(SID_EOS)
    return extra_args[SID_NODE], -1 if leaf_eos is None else leaf_eos


def mask_catalog_rows(
    catalog: SidCatalog,
    logits: torch.Tensor,
    rows: torch.Tensor,
    nodes: torch.Tensor,
    leaf_eos: torch.Tensor,
) -> torch.Tensor:
    """Masks ``logits[rows]`` to each row's trie node's children (a leaf: to
    its EOS, where one is allowed), with the sink of :func:`mask_with_sink`."""
    nodes = nodes.to(catalog.device)
    allowed = catalog.allowed_mask(nodes).to(logits.device)
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:  # the model's vocabulary may be padded
        pad = allowed.new_zeros(len(rows), vocab - allowed.shape[1])
        allowed = torch.cat((allowed, pad), dim=1)
    allowed = allowed[:, :vocab]
    # A leaf (a whole item) allows only its EOS.
    leaves = catalog.is_leaf(nodes).to(logits.device)
    eos = leaf_eos.to(logits.device)
    at_leaf = (leaves & (eos >= 0)).nonzero().squeeze(1)
    allowed[at_leaf, eos[at_leaf]] = True
    logits[rows] = mask_with_sink(logits[rows], allowed)
    return logits


def mask_with_sink(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[R, V]`` with disallowed entries at -inf but one, the sink
    (the first disallowed column), which holds their log-sum-exp: each row's
    log-softmax over the allowed columns equals that of the unmasked row."""
    dtype = logits.dtype
    x = logits.float()
    rest = torch.logsumexp(x.masked_fill(allowed, float("-inf")), dim=1)
    masked = x.masked_fill(~allowed, float("-inf"))
    disallowed = ~allowed
    has_sink = disallowed.any(dim=1)
    sink = disallowed.int().argmax(dim=1)  # first disallowed column
    rows = torch.arange(len(x), device=x.device)[has_sink]
    masked[rows, sink[has_sink]] = rest[has_sink]
    return masked.to(dtype)
