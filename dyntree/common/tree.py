"""Draft trees: the one data structure every drafter produces and every verifier consumes.

A :class:`DraftTree` is a flat, topologically ordered list of nodes. Node 0 is the root: the
last committed token, which is *not* yet in the KV cache. Every other node is a draft token whose
parent comes earlier in the list. From the flat arrays we derive what a verify pass needs:

* ``ancestor_mask()``: ``mask[i, j]`` is True iff node ``j`` is node ``i`` or one of its
  ancestors (the tree-attention mask over the tree part; the committed prefix is visible to all);
* ``positions(prefix_len)``: the RoPE position of each node, ``prefix_len + depth``;
* ``path(i)``: the node indices from the root to ``i``.

:class:`TreeBatch` pads several trees to one width for a batched forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = ["DraftTree", "TreeBatch", "TreeError"]


class TreeError(ValueError):
    """A draft tree violates its invariants (the message says which)."""


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
        if bool((tokens < 0).any()):
            raise TreeError("DraftTree.tokens must be non-negative token ids")
        if int(parents[0]) != -1:
            raise TreeError("DraftTree.parents[0] must be -1 (node 0 is the root)")
        idx = torch.arange(n)
        if n > 1 and bool(((parents[1:] < 0) | (parents[1:] >= idx[1:])).any()):
            bad = int(idx[1:][(parents[1:] < 0) | (parents[1:] >= idx[1:])][0])
            raise TreeError(
                f"DraftTree node {bad} has parent {int(parents[bad])}: parents must come "
                "before children (0 <= parent < index)"
            )
        if bool(((probs < 0) | (probs > 1) | probs.isnan()).any()):
            raise TreeError("DraftTree.draft_probs must lie in [0, 1]")
        if self.draft_dists is not None:
            d = self.draft_dists
            if d.dim() != 2 or d.shape[0] != n:
                raise TreeError(f"DraftTree.draft_dists must have shape [{n}, V], got {tuple(d.shape)}")
        depths = torch.zeros(n, dtype=torch.int64)
        ancestors = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(parents.tolist()[1:], start=1):  # parents precede children: one pass
            depths[i] = depths[p] + 1
            ancestors[i] |= ancestors[p]
        object.__setattr__(self, "depths", depths)
        object.__setattr__(self, "_ancestors", ancestors)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def root_only(cls, token: int) -> "DraftTree":
        """A tree with no drafts: verifying it is one step of plain decoding."""
        return cls(
            torch.tensor([token], dtype=torch.int64),
            torch.tensor([-1], dtype=torch.int64),
            torch.ones(1),
        )

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

    def ancestor_mask(self) -> torch.Tensor:
        """``[N, N]`` bool; ``mask[i, j]`` iff ``j`` is ``i`` or an ancestor of ``i``.

        Computed once at construction (the engine needs it for the batch mask and again for
        verification); treat it as read-only."""
        return self._ancestors

    def positions(self, prefix_len: int) -> torch.Tensor:
        """``[N]`` int64 positions: ``prefix_len + depth`` (the root sits at ``prefix_len``)."""
        return self.depths + prefix_len

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
    def from_trees(cls, trees: Sequence[DraftTree]) -> "TreeBatch":
        if not trees:
            raise TreeError("TreeBatch needs at least one tree")
        width = max(t.size for t in trees)
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
