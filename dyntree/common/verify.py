"""Tree accept: which drafted path the target agrees with (greedy and sampled), for a whole batch.

Both functions take padded ``[B, T]`` node arrays (the :class:`~dyntree.common.tree.TreeBatch`
convention: node 0 is the root, parents precede children, a node ``i > 0`` whose parent is ``-1``
is padding and never accepted) and return

* ``accept_index``: ``[B, T]`` int64, the accepted path's node indices root first, padded with
  ``-1`` (``accept_index[b, 0] == 0`` always);
* ``accept_len``: ``[B]`` int64, the path length *including the root*; the path ends at node
  ``accept_index[b, accept_len[b] - 1]``.

**Greedy** (:func:`greedy_accept`): node ``i > 0`` *matches* iff ``tokens[i] ==
target_argmax[parents[i]]``; a node is accepted iff it and all its non-root ancestors match; the
path ends at the deepest accepted node (ties: lowest index), and the bonus token is
``target_argmax[end]``. Committing the path's drafts and the bonus is exactly greedy decoding.

**Sampling** (:func:`sampling_accept`): node ``i > 0`` *passes* iff ``coins[i] * draft_probs[i] <
target_probs[i]``, i.e. ``coins[i] < min(1, p/q)``. From the root, move to the lowest-index child
that passes; stop when none does. Lossless when ``p``/``q`` are each node's residual-adjusted
probabilities given the siblings rejected before it, which
:func:`~dyntree.common.sampling.node_accept_probs` computes; the bonus is then drawn from the end
node's residual distribution.

These are the core's verification and, unchanged, the torch references of the
``tree_accept_*`` kernels (:mod:`dyntree.kernels.tree_accept`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dyntree.common.tree import DraftTree
from dyntree.kernels.accept_reference import check_tree_arrays, greedy_accept, greedy_path, pack_paths, sampling_accept

__all__ = ["VerifyResult", "argmax_rows", "check_tree_arrays", "greedy_accept", "greedy_path", "pack_paths", "sampling_accept",
           "greedy_verify"]

#: Block sizes :func:`argmax_rows` may split a vocabulary into (the first that divides it).
ARGMAX_BLOCKS = (512, 256, 128)


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


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` of CPU ``[N, V]`` logits, exactly (the first maximum of each row), found
    block by block: each block's maximum (``amax``, which vectorises where ``argmax`` does not),
    the first block holding the row's maximum, then the argmax inside that block alone. A NaN
    counts as the maximum, as in ``torch.argmax``. Vocabularies no block size divides take
    ``torch.argmax``."""
    n, v = x.shape
    block = next((b for b in ARGMAX_BLOCKS if v % b == 0), 0)
    if x.device.type != "cpu" or not block or v < 4 * block:
        return x.argmax(-1)
    blocks = x.reshape(n, v // block, block)
    first = blocks.amax(-1).argmax(-1)  # the first block holding the maximum (or a NaN)
    return first * block + blocks[torch.arange(n), first].argmax(-1)


def greedy_verify(tree: DraftTree, target_argmax: torch.Tensor) -> VerifyResult:
    """Verify one ``tree`` against ``target_argmax`` (``[N]``, the target's argmax at each node)."""
    n = tree.size
    if target_argmax.shape != (n,):
        raise ValueError(f"target_argmax must have shape [{n}], got {tuple(target_argmax.shape)}")
    index, length, bonus = greedy_accept(tree.tokens[None], tree.parents[None], target_argmax.to(torch.int64).cpu()[None])
    path = index[0, : int(length[0])].tolist()
    return VerifyResult(path, tree.tokens[path[1:]].tolist() + [int(bonus[0])])
