"""Tree accept: the torch references against hand-worked trees and a path-enumeration oracle,
and the Triton kernels (interpreter) against the references over random padded tree batches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _kernel_cases import random_tree
from dyntree.common.tree import DraftTree, TreeBatch
from dyntree.kernels import dispatch
from dyntree.kernels._triton import HAS_TRITON
from dyntree.kernels.tree_accept import (
    tree_accept_greedy_reference,
    tree_accept_greedy_triton,
    tree_accept_sampling_reference,
    tree_accept_sampling_triton,
)

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

#        0 (root, token 10)
#       / \
#  1 (11)  2 (12)
#     |      |   \
#  3 (13)  4 (14) 5 (15)
#            |
#          6 (16)
TREE = DraftTree(
    torch.tensor([10, 11, 12, 13, 14, 15, 16]),
    torch.tensor([-1, 0, 0, 1, 2, 2, 4]),
    torch.ones(7),
)


def _greedy(tokens, parents, top, backend="torch"):
    return dispatch.tree_accept_greedy(tokens, parents, top, backend=backend)


def test_greedy_hand_worked() -> None:
    b = TreeBatch.from_trees([TREE])
    # Target wants 12 after the root, 14 after node 2, 99 after node 4: path 0-2-4, bonus 99.
    top = torch.tensor([[12, 0, 14, 0, 99, 0, 0]])
    index, length, bonus = _greedy(b.tokens, b.parents, top)
    assert index.tolist() == [[0, 2, 4, -1, -1, -1, -1]] and length.tolist() == [3] and bonus.tolist() == [99]
    # A deeper match below a rejected node does not count: node 6 matches 4's argmax but 4 fails.
    top = torch.tensor([[12, 0, 77, 0, 16, 0, 5]])
    index, length, bonus = _greedy(b.tokens, b.parents, top)
    assert index[0, :2].tolist() == [0, 2] and length.tolist() == [2] and bonus.tolist() == [77]
    # Nothing matches: only the root, bonus = argmax at the root.
    index, length, bonus = _greedy(b.tokens, b.parents, torch.full((1, 7), 3))
    assert index[0, 0] == 0 and length.tolist() == [1] and bonus.tolist() == [3]


def test_greedy_tie_picks_lowest_index() -> None:
    tree = DraftTree(torch.tensor([1, 5, 5]), torch.tensor([-1, 0, 0]), torch.ones(3))
    b = TreeBatch.from_trees([tree])
    index, length, bonus = _greedy(b.tokens, b.parents, torch.tensor([[5, 8, 9]]))
    assert index.tolist() == [[0, 1, -1]] and bonus.tolist() == [8]


def _oracle_greedy(tree: DraftTree, top: torch.Tensor) -> tuple[list[int], int]:
    """Enumerate every node's root path; keep the deepest fully matching one (lowest index)."""
    best: list[int] = [0]
    for i in range(tree.size):
        path = tree.path(i)
        if all(int(tree.tokens[n]) == int(top[p]) for p, n in zip(path, path[1:])) and len(path) > len(best):
            best = path
    return best, int(top[best[-1]])


def _random_batch(seed: int, sizes: list[int], vocab: int = 3):
    gen = torch.Generator().manual_seed(seed)
    trees = [random_tree(gen, n, vocab=vocab) for n in sizes]
    return gen, trees, TreeBatch.from_trees(trees)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=4), st.integers(0, 2**31 - 1))
def test_greedy_reference_matches_oracle(sizes: list[int], seed: int) -> None:
    gen, trees, batch = _random_batch(seed, sizes)
    top = torch.randint(0, 3, batch.tokens.shape, generator=gen)
    index, length, bonus = tree_accept_greedy_reference(batch.tokens, batch.parents, top)
    for r, tree in enumerate(trees):
        path, want_bonus = _oracle_greedy(tree, top[r])
        assert index[r, : len(path)].tolist() == path and int(length[r]) == len(path)
        assert bool((index[r, len(path) :] == -1).all()) and int(bonus[r]) == want_bonus


@needs_triton
@settings(max_examples=12, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=4), st.integers(0, 2**31 - 1))
def test_greedy_triton_matches_reference(sizes: list[int], seed: int) -> None:
    gen, _, batch = _random_batch(seed, sizes)
    top = torch.randint(0, 3, batch.tokens.shape, generator=gen)
    want = tree_accept_greedy_reference(batch.tokens, batch.parents, top)
    got = tree_accept_greedy_triton(batch.tokens, batch.parents, top)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_sampling_hand_worked() -> None:
    b = TreeBatch.from_trees([TREE])
    p = torch.tensor([[1.0, 0.5, 0.5, 0.9, 0.2, 0.6, 0.3]])
    q = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.4, 0.6, 0.1]])
    # Node 1 fails (0.7 >= 0.5); node 2 passes; under 2, node 4 fails (0.6*0.4 >= 0.2), node 5
    # passes (0.5*0.6 < 0.6); node 5 is a leaf: path 0-2-5.
    coins = torch.tensor([[0.0, 0.7, 0.1, 0.0, 0.6, 0.5, 0.0]])
    index, length = dispatch.tree_accept_sampling(b.parents, p, q, coins, backend="torch")
    assert index.tolist() == [[0, 2, 5, -1, -1, -1, -1]] and length.tolist() == [3]
    # q == 0 passes iff p > 0; p == 0 never passes.
    q0 = q.clone()
    q0[0, 1] = 0.0
    index, _ = dispatch.tree_accept_sampling(b.parents, p, q0, coins, backend="torch")
    assert index[0, :3].tolist() == [0, 1, 3]
    index, length = dispatch.tree_accept_sampling(b.parents, torch.zeros(1, 7), q, torch.zeros(1, 7), backend="torch")
    assert length.tolist() == [1]


@needs_triton
@settings(max_examples=12, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=4), st.integers(0, 2**31 - 1))
def test_sampling_triton_matches_reference(sizes: list[int], seed: int) -> None:
    gen, _, batch = _random_batch(seed, sizes)
    shape = batch.tokens.shape
    p, q, coins = (torch.rand(shape, generator=gen) for _ in range(3))
    q[torch.rand(shape, generator=gen) < 0.1] = 0.0
    want = tree_accept_sampling_reference(batch.parents, p, q, coins)
    got = tree_accept_sampling_triton(batch.parents, p, q, coins)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_accept_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="target_argmax"):
        tree_accept_greedy_reference(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="coins"):
        tree_accept_sampling_reference(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(3))
