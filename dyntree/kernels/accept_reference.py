"""The tree-accept references the accept kernels are checked against: padded ``[B, T]`` node
arrays in, each tree's accepted path (root first, ``-1`` padded) and its length out.
"""

from __future__ import annotations

import torch

__all__ = ["check_tree_arrays", "greedy_accept", "greedy_path", "pack_paths", "sampling_accept"]


def check_tree_arrays(**arrays: torch.Tensor) -> tuple[int, int]:
    """Shapes of padded ``[B, T]`` node arrays (all equal, at least one node); raises otherwise."""
    shape: tuple[int, ...] | None = None
    for name, t in arrays.items():
        if t.dim() != 2:
            raise ValueError(f"{name} must be [B, T], got {tuple(t.shape)}")
        if shape is None:
            shape = tuple(t.shape)
        elif tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape} like the other node arrays")
        if t.shape[1] == 0:
            raise ValueError(f"{name} has no nodes: every tree has at least its root")
    assert shape is not None
    return shape[0], shape[1]


def _path_to(parents: list[int], end: int) -> list[int]:
    path = [end]
    while path[-1] > 0:
        path.append(parents[path[-1]])
    return path[::-1]


def pack_paths(paths: list[list[int]], width: int, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, width]`` the lists (accepted paths' node indices) ``-1`` padded, ``[B]`` their lengths)."""
    index = torch.tensor([p + [-1] * (width - len(p)) for p in paths], dtype=torch.int64, device=device)
    return index, torch.tensor([len(p) for p in paths], dtype=torch.int64, device=device)


def greedy_path(tokens: list[int], parents: list[int], target_argmax: list[int]) -> list[int]:
    """One tree's greedy accepted path, root first (node ``i > 0`` with parent ``-1`` is padding);
    the bonus token is ``target_argmax[path[-1]]``. Plain lists: the host walk behind
    :func:`greedy_accept`, which an engine verifying a few small trees calls directly."""
    t = len(tokens)
    accepted = [True] + [False] * (t - 1)
    depth = [0] * t
    end = 0
    for i in range(1, t):
        p = parents[i]
        if 0 <= p < i:  # padding (parent -1) is never accepted
            accepted[i] = accepted[p] and tokens[i] == target_argmax[p]
            depth[i] = depth[p] + 1
            if accepted[i] and depth[i] > depth[end]:
                end = i
    return _path_to(parents, end)


def greedy_accept(
    tokens: torch.Tensor, parents: torch.Tensor, target_argmax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy tree accept: ``(accept_index [B, T], accept_len [B] incl. root, bonus [B])``."""
    b, t = check_tree_arrays(tokens=tokens, parents=parents, target_argmax=target_argmax)
    paths, bonus = [], []
    for tok, par, top in zip(tokens.tolist(), parents.tolist(), target_argmax.tolist()):
        paths.append(greedy_path(tok, par, top))
        bonus.append(top[paths[-1][-1]])
    index, lens = pack_paths(paths, t, tokens.device)
    return index, lens, torch.tensor(bonus, dtype=torch.int64, device=tokens.device)


def sampling_accept(
    parents: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor, coins: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampling tree accept (per-node ``coin * q < p``, lowest-index descent):
    ``(accept_index [B, T], accept_len [B] incl. root)``. The test runs in the inputs' dtype."""
    b, t = check_tree_arrays(parents=parents, target_probs=target_probs, draft_probs=draft_probs, coins=coins)
    dtype = torch.promote_types(torch.promote_types(target_probs.dtype, draft_probs.dtype), coins.dtype)
    test = (coins.to(dtype) * draft_probs.to(dtype) < target_probs.to(dtype)).tolist()
    paths = []
    for par, ok in zip(parents.tolist(), test):
        passes = [i > 0 and 0 <= par[i] < i and ok[i] for i in range(t)]
        end = 0
        while True:
            nxt = next((i for i in range(end + 1, t) if par[i] == end and passes[i]), None)
            if nxt is None:
                break
            end = nxt
        paths.append(_path_to(par, end))
    return pack_paths(paths, t, parents.device)
