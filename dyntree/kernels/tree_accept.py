"""Tree accept on the device: pick each request's accepted root-to-node path in one launch.

Inputs use the :class:`~dyntree.common.tree.TreeBatch` conventions: ``[B, T]`` node arrays,
node 0 is the root, parents precede children, and a node ``i > 0`` whose parent is ``-1`` is
padding (never accepted). Both variants return

* ``accept_index``: ``[B, T]`` int64, the accepted path's node indices root first, padded with
  ``-1`` (``accept_index[b, 0] == 0`` always);
* ``accept_len``: ``[B]`` int64, the path length *including the root* (``>= 1``); the number of
  accepted draft tokens is ``accept_len - 1``, and the path ends at node
  ``accept_index[b, accept_len[b] - 1]``.

The torch references are :mod:`dyntree.kernels.accept_reference`, imported here under the
kernel names; the core's verification (:mod:`dyntree.common.verify`) uses the same functions, so
there is one accept.

**Greedy** (:func:`tree_accept_greedy_reference`): node ``i > 0`` *matches* iff
``tokens[i] == target_argmax[parents[i]]``; a node is accepted iff it and all its non-root
ancestors match; the path ends at the deepest accepted node (ties: lowest index). The bonus
token is ``target_argmax[end]``. This is exactly greedy decoding of the target.

**Sampling** (:func:`tree_accept_sampling_reference`): node ``i > 0`` *passes* iff
``coins[i] * draft_probs[i] < target_probs[i]``, i.e. ``coins[i] < min(1, p/q)`` (for ``q == 0``
it passes iff ``p > 0``; ``<`` vs ``<=`` differs only on a null set of coins). The path is
resolved top-down: from the root, move to the lowest-index child that passes; stop when no child
of the current node passes. The kernel does only this per-node test and path resolution. It is
lossless when each node's ``p``/``q`` are the caller's residual-adjusted probabilities of that
node's token given the siblings rejected before it (SpecInfer-style multi-draft rejection); the
caller then samples the bonus token at the end node from the residual distribution left after
its rejected children. Building those probabilities and the bonus draw is
:mod:`dyntree.common.sampling`'s job; the end node is all it needs from here.
"""

from __future__ import annotations

import torch

from dyntree.kernels.accept_reference import check_tree_arrays
from dyntree.kernels.accept_reference import greedy_accept as tree_accept_greedy_reference
from dyntree.kernels.accept_reference import sampling_accept as tree_accept_sampling_reference
from dyntree.kernels._triton import HAS_TRITON, next_pow2, tl, triton

__all__ = [
    "tree_accept_greedy_reference",
    "tree_accept_sampling_reference",
    "tree_accept_greedy_triton",
    "tree_accept_sampling_triton",
]


if HAS_TRITON:

    @triton.jit
    def _greedy_accept_kernel(
        TOK, PAR, TOP, OUT_INDEX, OUT_LEN, OUT_BONUS, num_nodes,
        stride_tok, stride_par, stride_top, stride_out, BLOCK_T: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        idx = tl.arange(0, BLOCK_T)
        in_tree = idx < num_nodes
        par = tl.load(PAR + b * stride_par + idx, mask=in_tree, other=-1).to(tl.int32)
        valid = in_tree & ((idx == 0) | ((par >= 0) & (par < idx)))
        # Walk every node up to the root at once: accepted iff every non-root node on the way matches.
        ok = valid
        depth = tl.zeros([BLOCK_T], dtype=tl.int32)
        cur = tl.where(valid, idx, 0)
        for _ in range(1, num_nodes):
            step = cur > 0
            cur_par = tl.load(PAR + b * stride_par + cur, mask=step, other=0).to(tl.int32)
            linked = cur_par >= 0  # False where a node hangs off a padding node
            cur_tok = tl.load(TOK + b * stride_tok + cur, mask=step, other=0)
            want = tl.load(TOP + b * stride_top + cur_par, mask=step & linked, other=0)
            ok = ok & (((cur_tok == want) & linked) | ~step)
            depth += step.to(tl.int32)
            cur = tl.where(step & linked, cur_par, 0)
        key = tl.where(ok, depth * BLOCK_T + (BLOCK_T - 1 - idx), -1)
        best = tl.max(key, 0)
        end = BLOCK_T - 1 - best % BLOCK_T
        end_depth = best // BLOCK_T
        # Mark the path by walking up from its end node, then scatter it root first by depth.
        on_path = idx == end
        node = end
        for _ in range(0, end_depth):
            node = tl.load(PAR + b * stride_par + node).to(tl.int32)
            on_path = on_path | (idx == node)
        tl.store(OUT_INDEX + b * stride_out + depth, idx.to(tl.int64), mask=on_path)
        tl.store(OUT_INDEX + b * stride_out + idx, tl.full([BLOCK_T], -1, tl.int64), mask=in_tree & (idx > end_depth))
        tl.store(OUT_LEN + b, (end_depth + 1).to(tl.int64))
        tl.store(OUT_BONUS + b, tl.load(TOP + b * stride_top + end).to(tl.int64))

    @triton.jit
    def _sampling_accept_kernel(
        PAR, P, Q, COIN, OUT_INDEX, OUT_LEN, num_nodes,
        stride_par, stride_p, stride_q, stride_c, stride_out, BLOCK_T: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        idx = tl.arange(0, BLOCK_T)
        in_tree = idx < num_nodes
        par = tl.load(PAR + b * stride_par + idx, mask=in_tree, other=-1).to(tl.int32)
        p = tl.load(P + b * stride_p + idx, mask=in_tree, other=0.0).to(tl.float32)
        q = tl.load(Q + b * stride_q + idx, mask=in_tree, other=0.0).to(tl.float32)
        u = tl.load(COIN + b * stride_c + idx, mask=in_tree, other=1.0).to(tl.float32)
        passes = in_tree & (idx > 0) & (par >= 0) & (par < idx) & (u * q < p)
        on_path = idx == 0
        cur = tl.full([], 0, tl.int32)
        length = tl.full([], 1, tl.int32)
        for _ in range(1, num_nodes):
            nxt = tl.min(tl.where(passes & (par == cur), idx, BLOCK_T), 0)
            found = nxt < BLOCK_T
            on_path = on_path | (idx == tl.where(found, nxt, -1))
            cur = tl.where(found, nxt, cur)
            length += found.to(tl.int32)
        # Along a path indices increase, so rank among on-path nodes = position in the path.
        pos = tl.cumsum(on_path.to(tl.int32), 0) - 1
        tl.store(OUT_INDEX + b * stride_out + pos, idx.to(tl.int64), mask=on_path)
        tl.store(OUT_INDEX + b * stride_out + idx, tl.full([BLOCK_T], -1, tl.int64), mask=in_tree & (idx >= length))
        tl.store(OUT_LEN + b, length.to(tl.int64))


def tree_accept_greedy_triton(
    tokens: torch.Tensor, parents: torch.Tensor, target_argmax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton greedy tree accept, one program per request (same contract as the reference)."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    b, t = check_tree_arrays(tokens=tokens, parents=parents, target_argmax=target_argmax)
    for name, x in (("tokens", tokens), ("parents", parents), ("target_argmax", target_argmax)):
        if x.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous along the node dimension")
    index = torch.empty(b, t, dtype=torch.int64, device=tokens.device)
    lens = torch.empty(b, dtype=torch.int64, device=tokens.device)
    bonus = torch.empty(b, dtype=torch.int64, device=tokens.device)
    _greedy_accept_kernel[(b,)](
        tokens, parents, target_argmax, index, lens, bonus, t,
        tokens.stride(0), parents.stride(0), target_argmax.stride(0), index.stride(0),
        BLOCK_T=max(2, next_pow2(t)),
    )
    return index, lens, bonus


def tree_accept_sampling_triton(
    parents: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor, coins: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton sampling tree accept, one program per request (same contract as the reference)."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    b, t = check_tree_arrays(parents=parents, target_probs=target_probs, draft_probs=draft_probs, coins=coins)
    for name, x in (("parents", parents), ("target_probs", target_probs), ("draft_probs", draft_probs), ("coins", coins)):
        if x.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous along the node dimension")
    index = torch.empty(b, t, dtype=torch.int64, device=parents.device)
    lens = torch.empty(b, dtype=torch.int64, device=parents.device)
    _sampling_accept_kernel[(b,)](
        parents, target_probs, draft_probs, coins, index, lens, t,
        parents.stride(0), target_probs.stride(0), draft_probs.stride(0), coins.stride(0), index.stride(0),
        BLOCK_T=max(2, next_pow2(t)),
    )
    return index, lens
