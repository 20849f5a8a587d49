"""DraftTree invariants: ancestor mask, positions and paths over random trees; bad trees."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dyntree.common.tree import DraftTree, TreeBatch, TreeError


@st.composite
def trees(draw, max_nodes: int = 24) -> DraftTree:
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.rand(n))


def _ancestors(tree: DraftTree, i: int) -> set[int]:
    out = {i}
    while i > 0:
        i = int(tree.parents[i])
        out.add(i)
    return out


@settings(max_examples=150, deadline=None)
@given(trees(), st.integers(0, 1000))
def test_mask_positions_paths(tree: DraftTree, prefix: int) -> None:
    mask = tree.ancestor_mask()
    pos = tree.positions(prefix)
    for i in range(tree.size):
        anc = _ancestors(tree, i)
        assert {j for j in range(tree.size) if mask[i, j]} == anc
        path = tree.path(i)
        assert path[0] == 0 and path[-1] == i and set(path) == anc
        assert all(int(tree.parents[b]) == a for a, b in zip(path, path[1:]))
        assert int(pos[i]) == prefix + len(path) - 1
        assert int(tree.depths[i]) == len(path) - 1
        # no node ever sees a later node
        assert not mask[i, i + 1 :].any()


@settings(max_examples=50, deadline=None)
@given(st.lists(trees(12), min_size=1, max_size=4))
def test_tree_batch_pads_without_leaking(ts: list[DraftTree]) -> None:
    batch = TreeBatch.from_trees(ts)
    for r, t in enumerate(ts):
        n = t.size
        assert torch.equal(batch.mask[r, :n, :n], t.ancestor_mask())
        assert not batch.mask[r, :n, n:].any()  # real nodes never see padding
        pad = batch.mask[r, n:, :]
        assert torch.equal(pad, torch.eye(batch.width, dtype=torch.bool)[n:])  # padding sees itself only
        assert batch.valid[r].sum() == n


def test_chain_and_root_only() -> None:
    c = DraftTree.chain(5, [6, 7, 8])
    assert c.path(3) == [0, 1, 2, 3] and c.max_depth == 3
    assert torch.equal(c.ancestor_mask(), torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    r = DraftTree.root_only(9)
    assert r.size == 1 and r.root == 9 and r.max_depth == 0


@pytest.mark.parametrize(
    "tokens,parents,probs,msg",
    [
        ([1, 2], [-1, 1], [1, 1], "parents must come before children"),
        ([1, 2], [0, 0], [1, 1], "parents\\[0\\] must be -1"),
        ([1, 2, 3], [-1, 0], [1, 1, 1], "differ in length"),
        ([], [], [], "at least the root"),
        ([1, -2], [-1, 0], [1, 1], "non-negative"),
        ([1, 2], [-1, 0], [1, 1.5], "draft_probs must lie in"),
        ([1, 2, 3], [-1, 0, 2], [1, 1, 1], "parents must come before children"),
    ],
)
def test_malformed_trees_are_rejected(tokens, parents, probs, msg) -> None:
    with pytest.raises(TreeError, match=msg):
        DraftTree(torch.tensor(tokens, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64),
                  torch.tensor(probs, dtype=torch.float32))


def test_wrong_dtypes_and_dists_shape() -> None:
    with pytest.raises(TreeError, match="int64"):
        DraftTree(torch.tensor([1.0]), torch.tensor([-1]), torch.ones(1))
    with pytest.raises(TreeError, match="draft_dists"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 0]), torch.ones(2), torch.ones(3, 5))
    with pytest.raises(TreeError, match="outside"):
        DraftTree.chain(1, [2]).path(5)


def test_best_chain_follows_the_likeliest_child() -> None:
    # 0 -> 1 (0.3), 0 -> 2 (0.6) -> 3 (0.5), 2 -> 4 (0.5): ties keep the first child
    tree = DraftTree(torch.tensor([7, 8, 9, 10, 11]), torch.tensor([-1, 0, 0, 2, 2]),
                     torch.tensor([1.0, 0.3, 0.6, 0.5, 0.5]), torch.rand(5, 12))
    chain = tree.best_chain()
    assert chain.tokens.tolist() == [7, 9, 10] and chain.parents.tolist() == [-1, 0, 1]
    assert chain.draft_probs.tolist() == pytest.approx([1.0, 0.6, 0.5])
    assert torch.equal(chain.draft_dists, tree.draft_dists[[0, 2, 3]])
    assert chain.lead_chain == chain.size and chain.best_chain() is chain
