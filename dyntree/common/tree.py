"""Draft trees: the one data structure every drafter produces and every verifier consumes.

A :class:`DraftTree` is a flat, topologically ordered list of nodes. Node 0 is the root: the
last committed token, which is *not* yet in the KV cache. Every other node is a draft token whose
parent comes earlier in the list. From the flat arrays we derive what a verify pass needs:

* ``ancestor_mask()``: ``mask[i, j]`` is True iff node ``j`` is node ``i`` or one of its
  ancestors (the tree-attention mask over the tree part; the committed prefix is visible to all);
* ``positions(prefix_len)``: the RoPE position of each node, ``prefix_len + depth``;
* ``path(i)``: the node indices from the root to ``i``.

:class:`DraftBatch` is one step's trees for a whole batch, flat and ragged (node arrays back to
back, ``qo_indptr`` offsets, packed ancestor bits): the format the speculator hands to engines and
the kernels take. :class:`TreeBatch` is its padded view (every tree padded to the widest) for
engines that run a dense ``[B, T]`` forward.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from typing import Hashable, Sequence

import torch

from dyntree.kernels.ancestor_bits import WORD_BITS, pack_ancestor_bits, unpack_ancestor_bits

__all__ = ["DraftTree", "DraftBatch", "TreeBatch", "TreeError", "WORD_BITS", "pack_ancestor_bits",
           "unpack_ancestor_bits"]



class TreeError(ValueError):
    """A draft tree violates its invariants (the message says which)."""


#: The arrays every root-only tree has, but its token (:meth:`DraftTree.root_only`).
_ROOT_ONLY = {"parents": torch.tensor([-1], dtype=torch.int64), "draft_probs": torch.ones(1),
              "depths": torch.zeros(1, dtype=torch.int64), "_ancestors": torch.ones(1, 1, dtype=torch.bool)}


@dataclass(frozen=True)
class DraftTree:
    """A validated draft tree.

    Attributes:
        tokens: ``[N]`` int64 token ids; ``tokens[0]`` is the root (last committed token).
        parents: ``[N]`` int64 parent index per node; ``parents[0] == -1`` and
            ``0 <= parents[i] < i`` for ``i > 0`` (parents come before children).
        draft_probs: ``[N]`` float32 probability the drafter gave each node's token given its
            parent's path (the root has 1.0). Used to rank and calibrate, never for acceptance
            in greedy mode.
        draft_dists: optional ``[N, V]`` float32; row ``i`` is the draft distribution of the
            token *after* node ``i`` (the distribution node ``i``'s children were drawn from).
            Needed for lossless sampling; ``None`` for deterministic drafters.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor
    draft_dists: torch.Tensor | None = None
    depths: torch.Tensor = field(init=False, repr=False, compare=False)
    _ancestors: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tokens, parents, probs = self.tokens, self.parents, self.draft_probs
        for name, t in (("tokens", tokens), ("parents", parents), ("draft_probs", probs)):
            if not isinstance(t, torch.Tensor) or t.dim() != 1:
                raise TreeError(f"DraftTree.{name} must be a 1-D tensor")
        n = tokens.numel()
        if n == 0:
            raise TreeError("DraftTree must have at least the root node")
        if parents.numel() != n or probs.numel() != n:
            raise TreeError(
                f"DraftTree arrays differ in length: tokens={n}, parents={parents.numel()}, "
                f"draft_probs={probs.numel()}"
            )
        if tokens.dtype != torch.int64 or parents.dtype != torch.int64:
            raise TreeError("DraftTree.tokens and .parents must be int64")
        # checked on Python lists: a tree has a few dozen nodes, where each tensor op costs more
        # than the whole list pass (this runs for every tree of every step)
        token_list, parent_list = tokens.tolist(), parents.tolist()
        if min(token_list) < 0:
            raise TreeError("DraftTree.tokens must be non-negative token ids")
        if parent_list[0] != -1:
            raise TreeError("DraftTree.parents[0] must be -1 (node 0 is the root)")
        paths: list[list[int]] = [[0]]  # node indices root..i (parents precede children: one pass)
        for i, p in enumerate(parent_list[1:], start=1):
            if not 0 <= p < i:
                raise TreeError(
                    f"DraftTree node {i} has parent {p}: parents must come before children (0 <= parent < index)"
                )
            paths.append(paths[p] + [i])
        if not all(0.0 <= x <= 1.0 for x in probs.tolist()):  # a NaN fails the comparison too
            raise TreeError("DraftTree.draft_probs must lie in [0, 1]")
        if self.draft_dists is not None:
            d = self.draft_dists
            if d.dim() != 2 or d.shape[0] != n:
                raise TreeError(f"DraftTree.draft_dists must have shape [{n}, V], got {tuple(d.shape)}")
        bits = bytearray(n * n)  # row i: node i and its ancestors
        for i, path in enumerate(paths):
            for j in path:
                bits[i * n + j] = 1
        ancestors = torch.frombuffer(bits, dtype=torch.bool).view(n, n)
        object.__setattr__(self, "depths", torch.tensor([len(path) - 1 for path in paths], dtype=torch.int64))
        object.__setattr__(self, "_ancestors", ancestors)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def root_only(cls, token: int) -> "DraftTree":
        """A tree with no drafts: verifying it is one step of plain decoding. Valid by
        construction (only the token is checked): every request of a step that does not
        speculate gets one, so it skips the general checks."""
        if token < 0:
            raise TreeError("DraftTree.tokens must be non-negative token ids")
        tree = object.__new__(cls)
        object.__setattr__(tree, "tokens", torch.tensor([token], dtype=torch.int64))
        object.__setattr__(tree, "draft_dists", None)
        for name, value in _ROOT_ONLY.items():  # shared by every root-only tree: read-only, as a tree's arrays are
            object.__setattr__(tree, name, value)
        return tree

    @classmethod
    def chain(cls, root: int, drafts: Sequence[int], probs: Sequence[float] | None = None) -> "DraftTree":
        """A linear tree: root followed by ``drafts`` in order."""
        n = len(drafts) + 1
        p = [1.0] + (list(probs) if probs is not None else [1.0] * len(drafts))
        return cls(
            torch.tensor([root, *drafts], dtype=torch.int64),
            torch.arange(-1, n - 1, dtype=torch.int64),
            torch.tensor(p, dtype=torch.float32),
        )

    # -- derived views -------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self.tokens.numel()

    @property
    def root(self) -> int:
        return int(self.tokens[0])

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    @property
    def lead_chain(self) -> int:
        """How many leading nodes form a chain from the root (each one's parent is the node
        before it): the rows a causal kernel computes as they are, a branching tree's other nodes
        seeing nodes that are not their ancestors there."""
        parents = self.parents.tolist()
        return next((i for i in range(1, len(parents)) if parents[i] != i - 1), len(parents))

    def ancestor_mask(self) -> torch.Tensor:
        """``[N, N]`` bool; ``mask[i, j]`` iff ``j`` is ``i`` or an ancestor of ``i``.

        Computed once at construction (the engine needs it for the batch mask and again for
        verification); treat it as read-only."""
        return self._ancestors

    def positions(self, prefix_len: int) -> torch.Tensor:
        """``[N]`` int64 positions: ``prefix_len + depth`` (the root sits at ``prefix_len``)."""
        return self.depths + prefix_len

    def prefix(self, n: int) -> "DraftTree":
        """The first ``n`` nodes (parents precede children, so still a tree): what an engine that
        schedules only part of a tree verifies. Per-node fields of subclasses are cut alike."""
        if not 1 <= n <= self.size:
            raise TreeError(f"prefix({n}) of a tree of {self.size} nodes")
        if n == self.size:
            return self
        cut = {f.name: getattr(self, f.name)[:n] for f in dataclasses.fields(self)
               if f.init and isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **cut)

    def best_chain(self) -> "DraftTree":
        """The chain from the root through each node's likeliest child (the first of equals): a
        drafter's own tree where a chain was planned (an engine's causal attention verifies a chain
        as it is). Per-node fields of subclasses are cut alike; ``self`` when already a chain."""
        parents, probs = self.parents.tolist(), self.draft_probs.tolist()
        best: dict[int, int] = {}
        for i in range(1, len(parents)):
            if parents[i] not in best or probs[i] > probs[best[parents[i]]]:
                best[parents[i]] = i
        path = [0]
        while path[-1] in best:
            path.append(best[path[-1]])
        if len(path) == self.size:
            return self
        index = torch.tensor(path)
        cut = {f.name: getattr(self, f.name)[index] for f in dataclasses.fields(self)
               if f.init and isinstance(getattr(self, f.name), torch.Tensor)}
        cut["parents"] = torch.arange(-1, len(path) - 1, dtype=torch.int64)
        return dataclasses.replace(self, **cut)

    def path(self, i: int) -> list[int]:
        """Node indices from the root to node ``i`` (inclusive)."""
        if not 0 <= i < self.size:
            raise TreeError(f"node {i} is outside a tree of {self.size} nodes")
        out = [i]
        while i > 0:
            i = int(self.parents[i])
            out.append(i)
        return out[::-1]

    def children(self, i: int) -> list[int]:
        return [int(c) for c in torch.nonzero(self.parents == i).flatten()]


@dataclass(frozen=True)
class TreeBatch:
    """Trees of a batch padded to a common width ``T`` for one verify forward.

    Padding nodes (``valid == False``) see only themselves, sit at their request's root
    position, and are never accepted.
    """

    tokens: torch.Tensor  # [B, T] int64
    parents: torch.Tensor  # [B, T] int64 (-1 for root and padding)
    depths: torch.Tensor  # [B, T] int64
    mask: torch.Tensor  # [B, T, T] bool ancestor mask
    valid: torch.Tensor  # [B, T] bool
    sizes: list[int]

    @classmethod
    def from_trees(cls, trees: Sequence[DraftTree], width: int | None = None) -> "TreeBatch":
        """Pad ``trees`` to ``width`` nodes each (default: the widest tree)."""
        if not trees:
            raise TreeError("TreeBatch needs at least one tree")
        widest = max(t.size for t in trees)
        width = widest if width is None else width
        if width < widest:
            raise TreeError(f"a tree of {widest} nodes does not fit a width of {width}")
        b = len(trees)
        tokens = torch.zeros(b, width, dtype=torch.int64)
        parents = torch.full((b, width), -1, dtype=torch.int64)
        depths = torch.zeros(b, width, dtype=torch.int64)
        mask = torch.eye(width, dtype=torch.bool).repeat(b, 1, 1)
        valid = torch.zeros(b, width, dtype=torch.bool)
        for r, t in enumerate(trees):
            n = t.size
            tokens[r, :n] = t.tokens
            tokens[r, n:] = t.root
            parents[r, :n] = t.parents
            depths[r, :n] = t.depths
            mask[r, :n, :n] = t.ancestor_mask()
            valid[r, :n] = True
        return cls(tokens, parents, depths, mask, valid, [t.size for t in trees])

    @property
    def width(self) -> int:
        return self.tokens.shape[1]


@dataclass(frozen=True)
class DraftBatch:
    """One speculation step's draft trees for a batch of requests, flat and ragged.

    Request ``b`` owns nodes ``qo_indptr[b] : qo_indptr[b + 1]`` of the flat arrays (its tree's
    nodes in tree order, root first). ``parents`` are *local* indices within the request's tree
    (``-1`` for roots), the convention of every kernel and of :class:`DraftTree`.

    Attributes:
        request_ids: one id per request, in batch order.
        trees: the per-request :class:`DraftTree` objects (what the verifier walks).
        tokens: ``[N]`` int64 node tokens (``N`` = all nodes of all trees).
        parents: ``[N]`` int64 local parent index.
        depths: ``[N]`` int64 depth (root 0): the node's position is ``kv_len + depth``.
        qo_indptr: ``[B + 1]`` int64 offsets of each request's nodes.
    """

    request_ids: list[Hashable]
    trees: list[DraftTree]
    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    qo_indptr: torch.Tensor

    @classmethod
    def from_trees(cls, request_ids: Sequence[Hashable], trees: Sequence[DraftTree]) -> "DraftBatch":
        if len(request_ids) != len(trees) or not trees:
            raise TreeError(f"DraftBatch needs one tree per request, got {len(trees)} trees for {len(request_ids)} ids")
        sizes = torch.tensor([t.size for t in trees], dtype=torch.int64)
        indptr = torch.zeros(len(trees) + 1, dtype=torch.int64)
        indptr[1:] = sizes.cumsum(0)
        return cls(
            list(request_ids), list(trees),
            torch.cat([t.tokens for t in trees]), torch.cat([t.parents for t in trees]),
            torch.cat([t.depths for t in trees]), indptr,
        )  # fmt: skip

    @property
    def batch_size(self) -> int:
        return len(self.trees)

    @property
    def num_nodes(self) -> int:
        """All nodes of all trees (roots included): the verify forward's query tokens."""
        return int(self.qo_indptr[-1])

    @property
    def num_drafts(self) -> int:
        """Draft nodes of all trees (roots excluded)."""
        return self.num_nodes - self.batch_size

    def positions(self, kv_lens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """``[N]`` RoPE positions ``kv_len[b] + depth`` (each root sits right after its prefix)."""
        kv = torch.as_tensor(kv_lens, dtype=torch.int64)
        return torch.repeat_interleave(kv, self.qo_indptr.diff()) + self.depths

    def flat_index(self, request: int, nodes: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Flat indices of request ``request``'s local ``nodes``."""
        return int(self.qo_indptr[request]) + torch.as_tensor(nodes, dtype=torch.int64)

    @cached_property
    def tree_bits(self) -> torch.Tensor:
        """``[B, T_max, ceil(T_max / 32)]`` int32 packed ancestor masks (tree attention)."""
        return pack_ancestor_bits(self.padded().mask)

    def padded(self) -> "TreeBatch":
        """The padded ``[B, T_max]`` view for engines that run a dense batched forward."""
        return self._padded

    @cached_property
    def _padded(self) -> "TreeBatch":
        return TreeBatch.from_trees(self.trees)
