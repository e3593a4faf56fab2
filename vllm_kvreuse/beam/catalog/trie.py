"""The SID catalog as a trie over vocabulary token ids, held as torch tensors.

A catalog is a set of items, each a fixed-length sequence of ``depth`` token
ids (a semantic ID). It is built once (``SidCatalog.from_items``; from a file
with :func:`vllm_kvreuse.beam.catalog.file.load_catalog`) and then only read.

Layout (all tensors on one device, built once, never mutated):

- Nodes are numbered breadth-first: the root is node 0, then the nodes of
  level 1 (prefixes of one token), level 2, ... in lexicographic order of
  their prefixes. ``level_starts[d]`` is the first node of level ``d``;
  ``level_starts[depth + 1] == num_nodes``. Nodes of level ``depth`` are the
  leaves, one per distinct item.
- CSR, always present: node ``n``'s children are the nodes
  ``indptr[n] + 1 .. indptr[n + 1]``; edge ``e`` leads to node ``e + 1``
  (breadth-first numbering makes the child array implicit) and is labelled
  ``tokens[e]``, ascending within a node. ``keys[e] = parent * vocab_size +
  tokens[e]`` is ascending over all edges, so one ``searchsorted`` finds the
  child for any (node, token) pair.
- Dense tables, per level, when small enough: ``dense[d] = (base, table)``
  with ``table[n - level_starts[d], t - base]`` the child of node ``n`` by
  token ``t``, or -1. A level gets one when ``nodes_at_level x token_span <=
  dense_max_entries`` (``token_span`` = its largest token - its smallest + 1);
  it then serves :meth:`legal` without the ragged CSR gather.

Every operation is batched over beams: a ``[B]`` tensor of node ids in, no
Python loop over beams or candidates (loops run over levels only).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

DENSE_MAX_ENTRIES = 1 << 24
"""Default size rule: a level is also held dense if its table has at most
this many int32 entries (64 MiB)."""


@dataclass(frozen=True, slots=True)
class DenseLevel:
    """Child table of one level: ``table[local node, token - base]`` or -1."""

    base: int
    table: torch.Tensor  # [nodes at level, token span] int32


class SidCatalog:
    """A read-only trie of catalog items; see the module docstring for layout."""

    def __init__(
        self,
        *,
        indptr: torch.Tensor,
        tokens: torch.Tensor,
        level_starts: torch.Tensor,
        vocab_size: int,
        dense: dict[int, DenseLevel],
    ) -> None:
        self.indptr = indptr  # [num_nodes + 1] int64
        self.tokens = tokens  # [num_nodes - 1] int32
        self.level_starts = level_starts  # [depth + 2] int64
        self.vocab_size = vocab_size
        self.dense = dense
        parents = torch.repeat_interleave(
            torch.arange(len(indptr) - 1, device=indptr.device), indptr.diff()
        )
        self.keys = parents * vocab_size + tokens.long()  # [num_nodes - 1]
        self._starts = level_starts.tolist()
        degrees = indptr.diff()
        # Per level, its widest node's children: the rows' width at that level.
        self._widths = [
            int(degrees[a:b].max()) if b > a else 0
            for a, b in zip(self._starts, self._starts[1:], strict=False)
        ]
        assert bool((self.keys.diff() > 0).all()), "edges must be in trie order"

    # -- construction ----------------------------------------------------------

    @classmethod
    def from_items(
        cls,
        items: np.ndarray | torch.Tensor,
        vocab_size: int,
        *,
        dense_max_entries: int = DENSE_MAX_ENTRIES,
        device: torch.device | str | None = None,
    ) -> SidCatalog:
        """Builds the trie of ``items`` (``[num_items, depth]`` token ids).

        Duplicate rows collapse into one item. Raises ``ValueError`` for an
        empty catalog or a token outside ``[0, vocab_size)``.
        """
        rows = np.asarray(torch.as_tensor(items).cpu(), dtype=np.int64)
        if rows.ndim != 2 or rows.shape[0] == 0 or rows.shape[1] == 0:
            raise ValueError(f"a catalog needs [items, depth] > 0, got {rows.shape}")
        if rows.min() < 0 or rows.max() >= vocab_size:
            raise ValueError(f"catalog token ids must lie in [0, {vocab_size})")
        rows = _sorted_unique_rows(rows, vocab_size)
        num, depth = rows.shape
        # new[d][i]: row i starts a prefix of length d+1 not seen in row i-1.
        new = np.zeros((depth, num), dtype=bool)
        new[:, 0] = True
        changed = np.zeros(num - 1, dtype=bool)
        for d in range(depth):
            changed |= rows[1:, d] != rows[:-1, d]
            new[d, 1:] = changed
        level_sizes = [1, *(int(new[d].sum()) for d in range(depth))]
        level_starts = np.cumsum([0, *level_sizes])
        tokens = np.concatenate([rows[new[d], d] for d in range(depth)])
        degrees = [np.array([level_sizes[1]])]
        dense: dict[int, DenseLevel] = {}
        for d in range(depth):
            # Local index of each row's prefix of length d (its parent at level d).
            parent = np.cumsum(new[d - 1]) - 1 if d else np.zeros(num, np.int64)
            parent = parent[new[d]]  # one per edge of level d
            if d:
                degrees.append(np.bincount(parent, minlength=level_sizes[d]))
            level_tokens = rows[new[d], d]
            base = int(level_tokens.min())
            span = int(level_tokens.max()) - base + 1
            if level_sizes[d] * span <= dense_max_entries:
                table = np.full((level_sizes[d], span), -1, dtype=np.int32)
                table[parent, level_tokens - base] = np.arange(
                    level_starts[d + 1], level_starts[d + 2], dtype=np.int32
                )
                dense[d] = DenseLevel(base, torch.from_numpy(table).to(device))
        degrees.append(np.zeros(level_sizes[depth], dtype=np.int64))  # leaves
        indptr = np.concatenate([[0], np.cumsum(np.concatenate(degrees))])
        return cls(
            indptr=torch.from_numpy(indptr).to(device),
            tokens=torch.from_numpy(tokens.astype(np.int32)).to(device),
            level_starts=torch.from_numpy(level_starts).to(device),
            vocab_size=vocab_size,
            dense=dense,
        )

    def to(self, device: torch.device | str) -> SidCatalog:
        """A copy of this catalog on ``device``."""
        return SidCatalog(
            indptr=self.indptr.to(device),
            tokens=self.tokens.to(device),
            level_starts=self.level_starts.to(device),
            vocab_size=self.vocab_size,
            dense={
                d: DenseLevel(level.base, level.table.to(device))
                for d, level in self.dense.items()
            },
        )

    # -- sizes -----------------------------------------------------------------

    @property
    def depth(self) -> int:
        """Tokens per item."""
        return len(self._starts) - 2

    @property
    def num_nodes(self) -> int:
        return self._starts[-1]

    @property
    def num_items(self) -> int:
        """Distinct items (= leaves)."""
        return self._starts[-1] - self._starts[-2]

    @property
    def device(self) -> torch.device:
        return self.indptr.device

    @property
    def nbytes(self) -> int:
        """Bytes held by the catalog's tensors."""
        held = [self.indptr, self.tokens, self.keys, self.level_starts]
        held += [level.table for level in self.dense.values()]
        return sum(t.numel() * t.element_size() for t in held)

    def items(self) -> np.ndarray:
        """The distinct items, ``[num_items, depth]``, in lexicographic order."""
        nodes = torch.arange(self._starts[-2], self._starts[-1], device=self.device)
        out = torch.empty((len(nodes), self.depth), dtype=torch.int64)
        for d in range(self.depth - 1, -1, -1):
            out[:, d] = self.tokens[nodes - 1].long().cpu()
            nodes = torch.searchsorted(self.indptr, nodes - 1, right=True) - 1
        return out.numpy()

    def uses_token(self, token: int) -> bool:
        """True if ``token`` appears in any item."""
        return bool((self.tokens == token).any())

    # -- batched lookups -------------------------------------------------------

    def level_at(self, node: int) -> int:
        """The level of one node id, on the host."""
        return bisect.bisect_right(self._starts, node) - 1

    def level_of(self, nodes: torch.Tensor) -> torch.Tensor:
        """``[B]`` level (prefix length) of each node."""
        return torch.searchsorted(self.level_starts, nodes, right=True) - 1

    def is_leaf(self, nodes: torch.Tensor) -> torch.Tensor:
        """``[B]`` bool: the node completes an item."""
        return nodes >= self._starts[-2]

    def legal(
        self, nodes: torch.Tensor, levels: Iterable[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each node's children: ``(tokens, children)``, both ``[B, M]`` int64.

        Row ``b`` lists node ``nodes[b]``'s allowed next tokens in ascending
        order, each with the child node it leads to; unused slots are -1
        (in both). ``M`` is at least the largest number of children among
        the nodes (a dense level's rows span its whole token range, holes
        included). A leaf's row is all -1. Nodes may be at mixed levels.

        ``levels``: the levels the nodes lie at, known to the caller, so the
        shapes are too and the host never waits for the device (``M`` is
        then each level's widest node's; a row at another level is
        unspecified). Without it they are read off the nodes.
        """
        nodes = self._check_nodes(nodes)
        level = self.level_of(nodes)
        starts = self.indptr[nodes]
        counts = self.indptr[nodes + 1] - starts
        if levels is None:  # read off the nodes: the host waits for them
            dense = [d for d in self.dense if bool((level == d).any())]
            counts = self._without(counts, level, dense)
            csr_width = int(counts.max()) if len(nodes) else 0
        else:
            known = set(levels)
            dense = [d for d in self.dense if d in known]
            counts = self._without(counts, level, dense)
            csr = [self._widths[d] for d in known - set(dense)]
            csr_width = max(csr, default=0)
        width = max([csr_width, *(self.dense[d].table.shape[1] for d in dense)])
        tokens = torch.full((len(nodes), width), -1, device=nodes.device)
        children = torch.full_like(tokens, -1)
        if csr_width:
            slots = torch.arange(csr_width, device=nodes.device)
            used = slots < counts[:, None]
            # Clamped so unused slots index something; masked right after.
            edges = (starts[:, None] + slots).clamp_(max=len(self.tokens) - 1)
            tokens[:, :csr_width] = torch.where(used, self.tokens[edges].long(), -1)
            children[:, :csr_width] = torch.where(used, edges + 1, -1)
        for d in dense:
            table = self.dense[d].table
            local = (nodes - self._starts[d]).clamp_(0, len(table) - 1)
            table, span = table[local].long(), table.shape[1]  # [B, span]
            span_tokens = torch.arange(span, device=nodes.device) + self.dense[d].base
            span_tokens = torch.where(table >= 0, span_tokens, -1)
            at = (level == d)[:, None]  # masks, not row ids: no wait
            tokens[:, :span] = torch.where(at, span_tokens, tokens[:, :span])
            children[:, :span] = torch.where(at, table, children[:, :span])
        return tokens, children

    @staticmethod
    def _without(
        counts: torch.Tensor, level: torch.Tensor, dense: list[int]
    ) -> torch.Tensor:
        """``counts`` with the rows of the ``dense`` levels at 0 (their rows
        come from the tables)."""
        for d in dense:
            counts = torch.where(level == d, 0, counts)
        return counts

    def child(self, nodes: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``[K]`` child of ``nodes[k]`` by ``tokens[k]``; -1 outside the catalog."""
        nodes = self._check_nodes(nodes)
        tokens = torch.as_tensor(tokens, device=self.device).long()
        in_vocab = (tokens >= 0) & (tokens < self.vocab_size)
        query = nodes * self.vocab_size + tokens.clamp(0, self.vocab_size - 1)
        pos = torch.searchsorted(self.keys, query).clamp_(max=len(self.keys) - 1)
        found = in_vocab & (self.keys[pos] == query)
        return torch.where(found, pos + 1, -1)

    def allowed_mask(self, nodes: torch.Tensor) -> torch.Tensor:
        """``[B, vocab_size]`` bool: True where the token continues an item."""
        tokens, _ = self.legal(nodes)
        mask = torch.zeros(
            (len(tokens), self.vocab_size + 1), dtype=torch.bool, device=self.device
        )
        # Unused slots (-1) write into the extra last column, dropped after:
        # no data-dependent shapes, so no device sync on CUDA.
        mask.scatter_(1, torch.where(tokens >= 0, tokens, self.vocab_size), True)
        return mask[:, : self.vocab_size]

    def mask_logprobs(
        self, logprobs: torch.Tensor, nodes: torch.Tensor, *, inplace: bool = False
    ) -> torch.Tensor:
        """``logprobs [B, V]`` with -inf outside the catalog.

        A new tensor, or ``logprobs`` itself, overwritten, if ``inplace``
        (on CPU, allocating a fresh [B, V] costs more than the masking).
        Not renormalised: an item's summed log-probs stay its
        log-probability under the model.
        """
        assert logprobs.shape[-1] == self.vocab_size, (
            f"log-prob rows have {logprobs.shape[-1]} columns, the catalog was "
            f"built for a vocabulary of {self.vocab_size}"
        )
        tokens, _ = self.legal(nodes)
        values = logprobs.gather(1, tokens.clamp(min=0))
        values.masked_fill_(tokens < 0, float("-inf"))
        if inplace:
            out = logprobs.fill_(float("-inf"))
        else:
            out = torch.full_like(logprobs, float("-inf"))
        # Unused slots point at token 0 with -inf; "amax" lets a real token
        # 0 win over them whatever the write order (no [B, V] bool mask).
        return out.scatter_reduce_(1, tokens.clamp(min=0), values, reduce="amax")

    def _check_nodes(self, nodes: torch.Tensor) -> torch.Tensor:
        """``nodes`` on the catalog's device, flat; checked in range where
        reading them is free (on CPU: the scheduler's lookups). On an
        accelerator the check would wait for the device, and a worker's
        nodes are in range by construction (the plan's, checked on the
        scheduler, then :meth:`child`'s, clamped)."""
        nodes = torch.as_tensor(nodes, device=self.device).long().reshape(-1)
        assert (
            nodes.device.type != "cpu"
            or len(nodes) == 0
            or (int(nodes.min()) >= 0 and int(nodes.max()) < self.num_nodes)
        ), f"node ids must lie in [0, {self.num_nodes}): a beam lost its node"
        return nodes


def _sorted_unique_rows(rows: np.ndarray, vocab_size: int) -> np.ndarray:
    """``rows`` deduplicated, in lexicographic order."""
    num, depth = rows.shape
    if vocab_size**depth < 2**63:
        # One int64 key per row: one sort instead of a multi-key lexsort.
        key = np.zeros(num, dtype=np.int64)
        for d in range(depth):
            key = key * vocab_size + rows[:, d]
        key.sort()  # numpy's unique() hashes int64: several times slower
        key = key[np.concatenate([[True], key[1:] != key[:-1]])]
        out = np.empty((len(key), depth), dtype=np.int64)
        for d in range(depth - 1, -1, -1):
            key, out[:, d] = np.divmod(key, vocab_size)
        return out
    rows = rows[np.lexsort(rows.T[::-1])]
    keep = np.ones(num, dtype=bool)
    keep[1:] = (rows[1:] != rows[:-1]).any(axis=1)
    return rows[keep]
