"""Drafters joined with ``+`` (:mod:`dyntree.common.drafters.union`): candidates merged per node,
one tree from both sources, lossless decoding, every call forwarded, and bad specs refused."""

from __future__ import annotations

from typing import Hashable, Sequence

import pytest
import torch

from dyntree.common.config import SpecConfig
from dyntree.common.drafter import Candidates, DraftRequest, Drafter
from dyntree.common.drafters import check_drafter_spec, make_drafter
from dyntree.common.drafters.ngram import NgramDrafter, NgramOptions
from dyntree.common.drafters.union import UnionDrafter, merge_candidates
from dyntree.common.speculator import SpecRequest, Speculator
from test_speculator import V, decode, plain


def _cands(ids: list[list[int]], probs: list[list[float]], entropy: list[float] | None = None) -> Candidates:
    return Candidates(torch.tensor(ids), torch.tensor(probs), None if entropy is None else torch.tensor(entropy))


def test_merge_keeps_the_larger_probability_of_a_shared_token_and_the_top_k() -> None:
    a = _cands([[5, 6, 7], [1, 0, 0]], [[0.5, 0.3, 0.1], [0.9, 0.0, 0.0]], [1.0, 0.2])
    b = _cands([[6, 9], [0, 0]], [[0.8, 0.05], [0.0, 0.0]], [0.3, 0.0])
    m = merge_candidates([a, b], 3)
    assert m.ids[0].tolist() == [6, 5, 7] and m.probs[0].tolist() == pytest.approx([0.8, 0.5, 0.1])
    # an empty slot (token 0, probability 0) never displaces or duplicates a real candidate
    assert m.ids[1].tolist() == [1, 0, 0] and m.probs[1].tolist() == pytest.approx([0.9, 0.0, 0.0])
    assert m.entropy.tolist() == pytest.approx([1.0, 0.2])


def test_merge_takes_a_later_parts_entropy_where_the_first_had_nothing() -> None:
    a = _cands([[3], [0]], [[0.7], [0.0]], [0.4, 0.0])
    b = _cands([[0], [8]], [[0.0], [0.6]], [0.0, 1.5])
    m = merge_candidates([a, b], 2)
    assert m.ids[1, 0] == 8 and m.probs[1, 0] == pytest.approx(0.6)
    assert m.entropy.tolist() == pytest.approx([0.4, 1.5])
    assert merge_candidates([_cands([[3]], [[0.7]]), _cands([[4]], [[0.2]], [0.1])], 2).entropy is None


class ShallowDrafter(Drafter):
    """Proposes one fixed wrong token at depth 1 only (a drafter whose heads end early), and
    records the calls the union forwards."""

    name = "shallow"
    needs_hidden = True
    max_depth = 1

    def __init__(self) -> None:
        self.calls: list[tuple[str, Hashable]] = []

    def expand(self, requests: Sequence[DraftRequest], frontiers: Sequence[Sequence[int]], partials, k: int,
               shaping, entropy: bool = True) -> Candidates:
        rows = []
        for front, part in zip(frontiers, partials):
            rows += [len(part.path_tokens(n)) == 1 for n in front]
        ids = torch.full((len(rows), 1), V - 1)
        probs = torch.tensor([[0.99 if r else 0.0] for r in rows])
        return Candidates(ids, probs, torch.zeros(len(rows)) if entropy else None)

    def observe_hidden(self, request_id: Hashable, states: torch.Tensor, start: int | None = None) -> None:
        self.calls.append(("hidden", request_id))

    def observe(self, request_id: Hashable, committed: Sequence[int], accepted_drafts: int) -> None:
        self.calls.append(("observe", request_id))

    def release(self, request_id: Hashable) -> None:
        self.calls.append(("release", request_id))


def test_union_tree_holds_both_drafters_candidates_and_goes_deeper_than_the_lead() -> None:
    shallow = ShallowDrafter()
    union = UnionDrafter([shallow, NgramDrafter()])
    assert union.name == "shallow+ngram" and union.needs_hidden and union.max_depth is None
    sp = Speculator(union, SpecConfig(drafter="ngram", max_nodes=8, max_depth=6, adaptive=False), vocab_size=V)
    seq = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    tree = sp.propose([SpecRequest("r", seq)]).trees[0]
    first = {int(tree.tokens[c]) for c in tree.children(0)}
    assert {V - 1, 4} <= first  # the lead's guess beside the n-gram continuation
    assert tree.max_depth >= 3  # the n-gram index extends below the lead's only depth


def test_union_decodes_exactly_and_forwards_every_call() -> None:
    shallow = ShallowDrafter()
    union = UnionDrafter([shallow, NgramDrafter()])
    prompts = {"a": [1, 2, 3, 1, 2], "b": [7, 7, 1, 4]}
    sp = Speculator(union, SpecConfig(drafter="ngram", max_nodes=6, max_depth=4, adaptive=False), vocab_size=V)
    sp.observe_hidden("a", torch.zeros(4, 2))
    out = decode(sp, prompts, 24)
    assert out == {rid: plain(p, 24) for rid, p in prompts.items()}
    sp.release("a")
    kinds = {k for k, _ in shallow.calls}
    assert {"hidden", "observe", "release"} <= kinds


def test_union_can_draft_when_any_part_can_and_cannot_tell_when_a_part_cannot() -> None:
    reqs = [DraftRequest("a", [5, 6, 7, 5, 6], 4, 4), DraftRequest("b", [1, 2, 3], 4, 4)]
    both = UnionDrafter([NgramDrafter(NgramOptions(min_n=2)), NgramDrafter()])
    assert both.can_draft(reqs) == [True, False]
    assert UnionDrafter([NgramDrafter(NgramOptions(min_n=3)), NgramDrafter()]).can_draft(reqs) == [True, False]
    assert UnionDrafter([NgramDrafter(NgramOptions(min_n=3)), NgramDrafter(NgramOptions(min_n=3))]).can_draft(reqs) == [False, False]
    assert UnionDrafter([ShallowDrafter(), NgramDrafter()]).can_draft(reqs) is None


def test_union_specs_are_checked_without_a_model() -> None:
    check_drafter_spec("hydra+ngram")
    check_drafter_spec("ngram:max_n=3+hydra")
    for bad, says in [("hydra+", "join distinct drafters"), ("ngram+ngram", "join distinct drafters"),
                      ("qspec+ngram", "'qspec' cannot be joined"), ("none+ngram", "'none' cannot be joined"),
                      ("foo+ngram", "unknown drafter 'foo'"), ("ngram:max_n=0+hydra", "max_n")]:
        with pytest.raises(ValueError, match=says):
            check_drafter_spec(bad)
    with pytest.raises(ValueError, match="needs the target"):
        make_drafter("ngram+hydra")
    with pytest.raises(ValueError, match="at least two"):
        UnionDrafter([NgramDrafter()])


def test_merge_with_one_part_offering_matches_the_general_merge() -> None:
    """When only one part offers candidates (the shortcut), the result is what merging them all
    gives: its top k in order, empty slots as token 0, the next part's entropy where the first had none."""
    lead = _cands([[5, 9, 2], [0, 0, 0]], [[0.5, 0.3, 0.1], [0.0, 0.0, 0.0]], [1.0, 2.0])
    dead = _cands([[0, 0], [0, 0]], [[0.0, 0.0], [0.0, 0.0]], [0.25, 0.5])
    m = merge_candidates([lead, dead], 2)
    assert m.ids.tolist() == [[5, 9], [0, 0]]
    assert torch.allclose(m.probs, torch.tensor([[0.5, 0.3], [0.0, 0.0]]))
    assert m.entropy is not None and m.entropy.tolist() == [1.0, 0.5]
    live = _cands([[7, 1], [0, 0]], [[0.2, 0.1], [0.0, 0.0]], [0.25, 0.5])
    general = merge_candidates([lead, live], 2)  # two parts offer: the general merge
    assert general.ids.tolist() == [[5, 9], [0, 0]] and general.entropy.tolist() == [1.0, 0.5]
