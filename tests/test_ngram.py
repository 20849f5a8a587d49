"""The n-gram (prompt lookup) drafter builds real trees within its budget."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from dyntree.common.drafter import DraftRequest, NoDrafter
from dyntree.common.drafters import drafter_names, make_drafter
from dyntree.common.drafters.ngram import NgramDrafter, NgramOptions


def _req(tokens, max_nodes=16, max_depth=8, rid=0):
    return DraftRequest(rid, tokens, max_nodes, max_depth)


def test_branches_for_different_continuations() -> None:
    # "1 2" was followed by 3 4 5 and later by 7 8: both continuations appear as siblings
    seq = [1, 2, 3, 4, 5, 9, 1, 2, 7, 8, 6, 1, 2]
    tree = NgramDrafter().propose([_req(seq)])[0]
    assert tree.root == 2
    kids = {int(tree.tokens[c]) for c in tree.children(0)}
    assert {3, 7} <= kids
    # the most recent continuation ranks at least as high as the older one (equal weight here)
    assert tree.size - 1 <= 16 and tree.max_depth <= 8


def test_budget_and_depth_are_respected() -> None:
    seq = list(range(10)) * 6
    for nodes, depth in [(0, 8), (1, 1), (3, 8), (16, 2), (40, 12)]:
        tree = NgramDrafter(NgramOptions(max_matches=16)).propose([_req(seq, nodes, depth)])[0]
        assert tree.size - 1 <= nodes and tree.max_depth <= depth


def test_chain_when_history_repeats_and_root_only_without_match() -> None:
    seq = [5, 6, 7, 8, 5, 6]
    tree = NgramDrafter().propose([_req(seq, 4, 4)])[0]
    assert tree.tokens.tolist()[:3] == [6, 7, 8]
    assert NgramDrafter().propose([_req([1, 2, 3])])[0].size == 1


def test_can_draft_says_whether_the_suffix_matches() -> None:
    d = NgramDrafter()
    reqs = [_req([5, 6, 7, 8, 5, 6], rid="a"), _req([1, 2, 3], rid="b"), _req([4, 4], rid="c"), _req([9], rid="d")]
    assert d.can_draft(reqs) == [True, False, True, False]
    assert [t.size > 1 for t in d.propose(reqs)] == [True, False, True, False]  # as the drafts turn out


def test_evidence_classes_the_longest_match() -> None:
    d = NgramDrafter()
    passage = list(range(10, 30))
    reqs = [_req(passage + [1] + passage[:9], rid="copy"), _req([5, 6, 7, 8, 5, 6], rid="short"),
            _req([1, 2, 3], rid="none")]
    # a 9-token match (class 4: 8-15 tokens), a 2-token one (class 2: 2-3), none (0)
    assert d.evidence(reqs) == [4, 2, 0]


def test_incremental_index_matches_a_fresh_one() -> None:
    d = NgramDrafter()
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    for k in range(5, len(seq)):
        inc = d.propose([_req(seq[:k])])[0]
        fresh = NgramDrafter().propose([_req(seq[:k])])[0]
        assert inc.tokens.tolist() == fresh.tokens.tolist() and inc.parents.tolist() == fresh.parents.tolist()
    d.release(0)


def test_registry_and_bad_specs() -> None:
    assert {"none", "ngram"} <= set(drafter_names())
    assert isinstance(make_drafter("none"), NoDrafter)
    assert make_drafter("ngram:max_n=2,min_n=2").options.max_n == 2
    with pytest.raises(ValueError, match="unknown drafter 'medusa'"):
        make_drafter("medusa")
    with pytest.raises(ValueError, match="key=value"):
        make_drafter("ngram:3")
    with pytest.raises(ValidationError, match="max_matches"):
        make_drafter("ngram:max_matches=0")
    with pytest.raises(ValidationError, match="bogus"):
        make_drafter("ngram:bogus=1")
    with pytest.raises(ValidationError, match="min_n"):
        make_drafter("ngram:min_n=5,max_n=2")
