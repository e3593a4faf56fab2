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
any costs one dict truth test.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from vllm_kvreuse.beam.catalog_setup import LEAF_EOS_KEY, NODE_KEY, engine_catalog

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
        extra_args = params.extra_args
        if not extra_args or extra_args.get(NODE_KEY) is None:
            return None
        leaf_eos = extra_args.get(LEAF_EOS_KEY)
        return extra_args[NODE_KEY], -1 if leaf_eos is None else leaf_eos

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.nodes or self.catalog is None:
            return logits
        rows = torch.tensor(list(self.nodes), device=logits.device)
        states = torch.tensor(list(self.nodes.values()))
        nodes = states[:, 0].to(self.catalog.device)
        allowed = self.catalog.allowed_mask(nodes).to(logits.device)
        vocab = logits.shape[1]
        if allowed.shape[1] < vocab:  # the model's vocabulary may be padded
            pad = allowed.new_zeros(len(rows), vocab - allowed.shape[1])
            allowed = torch.cat((allowed, pad), dim=1)
        allowed = allowed[:, :vocab]
        # A leaf (a whole item) allows only its EOS.
        leaves = self.catalog.is_leaf(nodes).to(logits.device)
        eos = states[:, 1].to(logits.device)
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
