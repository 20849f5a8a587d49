"""Greedy tree verification: which drafted path the target agrees with, and the bonus token.

Given the target's argmax at every node of a :class:`DraftTree` (the token the target would emit
after that node's path), a non-root node *matches* when its token equals the target's argmax at
its parent. The accepted path is the deepest node whose every non-root ancestor (and itself)
matches (ties: lowest index); the committed tokens are the path's draft tokens followed by the
target's argmax at the path's end (the bonus). This is token-identical to plain greedy decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dyntree.common.tree import DraftTree

__all__ = ["VerifyResult", "greedy_verify"]


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one tree.

    Attributes:
        accepted_nodes: node indices on the accepted path, root first (their KV is kept).
        tokens: newly committed tokens: the accepted draft tokens, then the bonus token.
    """

    accepted_nodes: list[int]
    tokens: list[int]

    @property
    def accepted_drafts(self) -> int:
        """How many draft tokens were accepted (0 = only the bonus token)."""
        return len(self.accepted_nodes) - 1


def greedy_verify(tree: DraftTree, target_argmax: torch.Tensor) -> VerifyResult:
    """Verify ``tree`` against ``target_argmax`` (``[N]``, the target's argmax at each node)."""
    n = tree.size
    if target_argmax.shape != (n,):
        raise ValueError(f"target_argmax must have shape [{n}], got {tuple(target_argmax.shape)}")
    target_argmax = target_argmax.to(torch.int64).cpu()
    match = torch.ones(n, dtype=torch.bool)
    if n > 1:
        match[1:] = tree.tokens[1:] == target_argmax[tree.parents[1:]]
    # a node is accepted iff no node on its root path fails to match
    accepted = ~(tree.ancestor_mask() & ~match).any(dim=1)
    score = torch.where(accepted, tree.depths * n - torch.arange(n), torch.full((n,), -1))
    end = int(score.argmax())
    path = tree.path(end)
    tokens = [int(tree.tokens[i]) for i in path[1:]] + [int(target_argmax[end])]
    return VerifyResult(path, tokens)
