"""Greedy tree verification against hand-built and random trees."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dyntree.common.tree import DraftTree
from dyntree.common.verify import argmax_rows, greedy_verify


def _tree(tokens, parents):
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.ones(len(tokens)))


def test_picks_the_matching_branch_not_the_first() -> None:
    #        0(r)
    #      /   \
    #     1:a   2:b
    #     |     |
    #     3:c   4:d
    tree = _tree([9, 10, 11, 12, 13], [-1, 0, 0, 1, 2])
    argmax = torch.tensor([11, 0, 13, 0, 42])  # target: after r -> b, after b -> d, after d -> 42
    res = greedy_verify(tree, argmax)
    assert res.accepted_nodes == [0, 2, 4]
    assert res.tokens == [11, 13, 42]
    assert res.accepted_drafts == 2


def test_argmax_rows_is_torch_argmax_exactly() -> None:
    """The blocked argmax gives torch's first maximum, ties within and across blocks included."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4096, generator=g)
    x[1, [700, 3000, 3001]] = 50.0  # a tie across blocks: the earlier block's column wins
    x[2, [1030, 1025]] = 50.0  # a tie inside one block: the lower column wins
    x[3] = 0.0  # every column ties
    x[4, :] = float("-inf")
    x[4, 4095] = -1e30  # the last column of the last block
    x[5, 0] = float("inf")
    for dtype in (torch.float32, torch.bfloat16):
        y = x.to(dtype)
        assert torch.equal(argmax_rows(y), y.argmax(-1)), dtype
    assert argmax_rows(x).tolist()[1:4] == [700, 1025, 0]
    coarse = torch.randint(0, 3, (5, 49152), generator=g).float()  # many ties in many blocks
    assert torch.equal(argmax_rows(coarse), coarse.argmax(-1))


def test_argmax_rows_falls_back_where_blocks_do_not_fit() -> None:
    g = torch.Generator().manual_seed(1)
    nan = torch.randn(3, 2048, generator=g)
    nan[1, 1500] = float("nan")  # torch's argmax points at a NaN
    odd = torch.randn(3, 1000, generator=g)  # no block size divides 1000
    for x in (nan, odd):
        assert torch.equal(argmax_rows(x), x.argmax(-1))
    assert int(argmax_rows(nan)[1]) == 1500


def test_no_match_gives_the_bonus_only() -> None:
    tree = _tree([9, 10, 11], [-1, 0, 1])
    res = greedy_verify(tree, torch.tensor([5, 6, 7]))
    assert res.accepted_nodes == [0] and res.tokens == [5]


def test_repeated_sibling_tokens_take_the_deeper_match() -> None:
    tree = _tree([9, 10, 10, 11], [-1, 0, 0, 2])
    res = greedy_verify(tree, torch.tensor([10, 3, 11, 4]))
    assert res.accepted_nodes == [0, 2, 3] and res.tokens == [10, 11, 4]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_equals_sequential_greedy_walk(data) -> None:
    """Walking the tree token by token with the target's argmax gives the same result."""
    n = data.draw(st.integers(1, 20))
    parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    argmax = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    tree = _tree(tokens, parents)
    res = greedy_verify(tree, torch.tensor(argmax))
    # the emitted tokens follow the target's argmax along the path
    for node, tok in zip(res.accepted_nodes, res.tokens):
        assert argmax[node] == tok
    # and the path cannot be extended: no child of its end matches
    end = res.accepted_nodes[-1]
    assert all(tokens[c] != argmax[end] for c in range(n) if parents[c] == end)
    # and it is a longest match: no deeper fully-matching path exists
    def depth_of_best(i: int) -> int:
        kids = [c for c in range(n) if parents[c] == i and tokens[c] == argmax[i]]
        return 1 + max((depth_of_best(c) for c in kids), default=0) if i else max((depth_of_best(c) for c in kids), default=0)
    assert res.accepted_drafts == depth_of_best(0)
