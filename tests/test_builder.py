"""Tree builder invariants (hypothesis), dyntree optimality and shaping, sampled draws,
online calibration, and the options' validation."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from dyntree.common.builder import MEDUSA_63, PartialTree, TreeBuilder, draw_children
from dyntree.common.calibration import AcceptanceTable, Calibrator, entropy
from dyntree.common.drafter import Candidates, top_candidates
from dyntree.common.options import CalibrationOptions, ControllerOptions, TreeOptions
from dyntree.common.sampling import sample_verify
from dyntree.common.tree import DraftTree


class ToyDrafter:
    """Draft distribution as a fixed function of the path's tokens; records expand calls."""

    def __init__(self, vocab: int, sharpness: float, seed: int = 0) -> None:
        self.vocab, self.sharpness, self.seed = vocab, sharpness, seed
        self.calls: list[list[int]] = []
        self.ks: list[int] = []  # candidates asked for per call

    def dist(self, path: list[int]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((self.seed, *path)) % (2**31))
        return torch.softmax(torch.randn(self.vocab, generator=g) * self.sharpness, -1)

    def __call__(self, frontier: list[int], partial: PartialTree, k: int) -> Candidates:
        self.calls.append([partial.depths[i] for i in frontier])
        self.ks.append(k)
        return top_candidates(torch.stack([self.dist(partial.path_tokens(i)) for i in frontier]).log(), k)


def _path_tokens(tree: DraftTree, i: int) -> list[int]:
    return [int(tree.tokens[j]) for j in tree.path(i)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    vocab=st.integers(3, 24),
    sharpness=st.sampled_from([0.3, 1.5, 4.0, 10.0]),
    seed=st.integers(0, 10_000),
    mode=st.sampled_from(["chain", "static", "dyntree", "beam"]),
    sampling=st.booleans(),
    iid=st.booleans(),
    max_nodes=st.integers(0, 40),
    max_depth=st.integers(0, 9),
    max_children=st.integers(1, 6),
    threshold=st.sampled_from([0.0, 0.01, 0.1, 0.5]),
    max_frontier=st.integers(1, 12),
    offered=st.sampled_from([None, 1, 3, 8]),
)
def test_builder_invariants(
    vocab: int, sharpness: float, seed: int, mode: str, sampling: bool, iid: bool, max_nodes: int,
    max_depth: int, max_children: int, threshold: float, max_frontier: int, offered: int | None,
) -> None:
    opts = TreeOptions(
        max_children=max_children, threshold=threshold, max_frontier=max_frontier,
        sampling_scheme="iid" if iid else "without_replacement",
    )
    drafter = ToyDrafter(vocab, sharpness, seed)
    tree = TreeBuilder(opts, candidates_per_node=offered).build(
        5, drafter, max_nodes=max_nodes, max_depth=max_depth, mode=mode,  # type: ignore[arg-type]
        sampling=sampling, generator=torch.Generator().manual_seed(seed), vocab_size=vocab,
    )
    sampling = sampling and mode != "beam"  # beam trees are deterministic (point-mass proposals)
    n = tree.size
    assert tree.root == 5 and n - 1 <= max_nodes and tree.max_depth <= max_depth
    assert all(0 <= int(tree.parents[i]) < i for i in range(1, n))  # parents before children
    assert len(drafter.calls) <= max_depth  # one expand call per depth ...
    for depth, call in enumerate(drafter.calls):
        assert call and set(call) == {depth}  # ... over that depth's frontier only
    assert (tree.draft_dists is not None) == (sampling and bool(drafter.calls))
    # the builder never asks for the whole vocabulary: the most candidates the mode can use
    width = max_children if offered is None else offered  # dyntree's most children of one node
    want_k = {"chain": 1, "static": 10, "dyntree": width, "beam": 1024}[mode]
    if sampling:
        want_k = max(want_k, opts.sampling_support)
    assert all(k <= want_k for k in drafter.ks)
    for i in range(1, n):
        par = int(tree.parents[i])
        q = drafter.dist(_path_tokens(tree, par))
        tok = int(tree.tokens[i])
        assert abs(float(tree.draft_probs[i]) - float(q[tok])) < 1e-5
        assert abs(float(tree.node_entropy[i]) - float(entropy(q))) < 1e-4
        # identity calibration: path value = product of draft probabilities along the path
        assert abs(float(tree.values[i]) - float(tree.values[par]) * float(q[tok])) < 1e-5
        if sampling:
            assert torch.allclose(tree.draft_dists[par], q)
    for i in range(n):
        toks = [int(tree.tokens[c]) for c in tree.children(i)]
        if not (sampling and iid):
            assert len(set(toks)) == len(toks), "siblings repeat a token"
        if mode == "dyntree":
            assert len(toks) <= width
        if mode == "dyntree" and not sampling:
            q = drafter.dist(_path_tokens(tree, i)) if toks else None
            if toks:  # greedy children are the most likely tokens, in rank order
                assert toks == torch.topk(q, len(toks)).indices.tolist()
    if mode == "dyntree" and not sampling and n > 1:
        assert float(tree.values[1:].min()) >= threshold
    if mode == "chain":
        assert n - 1 == min(max_nodes, max_depth) and tree.max_depth == n - 1
    if mode == "beam" and n > 1:  # per depth, the best children by path probability, at most the width
        width = -(-max_nodes // max(max_depth, 1))
        for d in range(1, tree.max_depth + 1):
            assert int((tree.depths == d).sum()) <= width
    if mode == "static":
        kept = [p for p in MEDUSA_63 if len(p) <= max_depth][:max_nodes]
        # softmax rows have full support: the whole truncated shape, minus ranks >= vocab
        assert n - 1 == sum(1 for p in kept if max(p) < vocab)


def _best_closed_value(drafter: ToyDrafter, opts: TreeOptions, n_max: int, d_max: int) -> float:
    """Reference: grow every candidate (no budget), then the best ancestor-closed n_max nodes."""
    big = TreeBuilder(opts.model_copy(update={"max_frontier": 1024}))
    full = big.build(0, drafter, max_nodes=1024, max_depth=d_max)
    vals = sorted(full.values[1:].tolist(), reverse=True)
    return sum(vals[:n_max])


@pytest.mark.parametrize("sharpness", [0.5, 2.0, 4.0])
def test_greedy_dyntree_keeps_the_most_valuable_nodes(sharpness: float) -> None:
    opts = TreeOptions(max_children=3, threshold=0.001, max_frontier=64)
    drafter = ToyDrafter(12, sharpness, seed=3)
    for n_max in (1, 5, 16):
        tree = TreeBuilder(opts).build(0, drafter, max_nodes=n_max, max_depth=4)
        want = _best_closed_value(drafter, opts, n_max, 4)
        assert tree.size - 1 == min(n_max, tree.size - 1)
        assert abs(tree.expected_accepted - want) < 1e-5


@pytest.mark.parametrize("n_max", [5, 16, 64])
def test_greedy_dyntree_does_not_expand_nodes_that_cannot_make_the_cut(n_max: int) -> None:
    # Once N nodes exist, a frontier node worth no more than the N-th best is not expanded: the
    # tree is the same, the drafter scores far fewer rows (sharp drafter, threshold 0: without the
    # pruning 15 / 64 / 174 rows here, with it 8 / 23 / 98).
    opts = TreeOptions(max_children=4, threshold=0.0, max_frontier=32)
    drafter = ToyDrafter(50, 4.0, seed=3)
    tree = TreeBuilder(opts).build(0, drafter, max_nodes=n_max, max_depth=8)
    rows = sum(len(c) for c in drafter.calls)
    want = _best_closed_value(drafter, opts, n_max, 8)
    assert tree.size - 1 == n_max and abs(tree.expected_accepted - want) < 1e-5
    assert rows <= 1.75 * n_max


def test_entropy_shapes_the_tree() -> None:
    opts = TreeOptions(max_children=4, entropy_low=0.3, entropy_high=2.0, threshold=0.0)
    peaked = TreeBuilder(opts).build(0, ToyDrafter(32, 60.0), max_nodes=8, max_depth=8)
    flat = TreeBuilder(opts).build(0, ToyDrafter(32, 0.05), max_nodes=8, max_depth=8)
    assert peaked.max_depth == 8 and len(peaked.children(0)) == 1  # confident: a deep chain
    assert len(flat.children(0)) == 4 and flat.max_depth <= 3  # uncertain: wide and shallow


def test_threshold_stops_weak_branches() -> None:
    tree = TreeBuilder(TreeOptions(threshold=0.2)).build(0, ToyDrafter(40, 0.1), max_nodes=32, max_depth=8)
    assert tree.size == 1  # a near-uniform draft over 40 tokens never reaches 0.2


def test_sampled_child_counts_are_decided_before_drawing() -> None:
    # The root's number of children may depend on its distribution, never on the draws.
    drafter = ToyDrafter(16, 1.0, seed=7)
    sizes = set()
    for seed in range(12):
        tree = TreeBuilder(TreeOptions(threshold=0.0)).build(
            0, drafter, max_nodes=3, max_depth=3, sampling=True, generator=torch.Generator().manual_seed(seed),
            vocab_size=drafter.vocab,
        )
        sizes.add(len(tree.children(0)))
    assert len(sizes) == 1


def _chi2_pvalue(counts: Counter, probs: dict, n: int) -> float:
    stat = sum((counts.get(k, 0) - p * n) ** 2 / (p * n) for k, p in probs.items())
    assert set(counts) <= set(probs)
    return float(torch.special.gammaincc(torch.tensor((len(probs) - 1) / 2), torch.tensor(stat / 2)))


@pytest.mark.parametrize("scheme", ["without_replacement", "iid"])
def test_draw_children_matches_the_scheme(scheme: str) -> None:
    q = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    n = 40_000
    drawn = draw_children(q.expand(n, 5), [2] * n, scheme, torch.Generator().manual_seed(5))  # type: ignore[arg-type]
    counts = Counter(tuple(d) for d in drawn)
    probs = {}
    for a, b in itertools.product(range(4), repeat=2):
        if scheme == "iid":
            probs[(a, b)] = float(q[a] * q[b])
        elif a != b:
            probs[(a, b)] = float(q[a] * q[b] / (1 - q[a]))
    assert _chi2_pvalue(counts, probs, n) > 1e-3


def test_sampled_builder_with_sample_verify_matches_target_first_token() -> None:
    """End to end: builder-drawn trees + sample_verify give the target's first-token law."""
    vocab, n = 4, 2000
    drafter = ToyDrafter(vocab, 1.0, seed=11)
    target = torch.tensor([0.1, 0.2, 0.3, 0.4])
    builder = TreeBuilder(TreeOptions(threshold=0.0, max_children=2))
    g = torch.Generator().manual_seed(0)
    counts: Counter = Counter()
    for _ in range(n):
        tree = builder.build(0, drafter, max_nodes=3, max_depth=2, sampling=True, generator=g, vocab_size=vocab)
        tp = torch.stack([torch.roll(target, int(tree.tokens[i])) for i in range(tree.size)])
        counts[(sample_verify(tree, tp, g).tokens[0],)] += 1
    assert _chi2_pvalue(counts, {(y,): float(target[y]) for y in range(vocab)}, n) > 1e-3


def test_calibrator_starts_at_identity_and_learns() -> None:
    cal = Calibrator(CalibrationOptions(confidence_bins=5, prior_strength=4.0, decay=1.0))
    conf = torch.tensor([0.05, 0.5, 0.93])
    depth, ent = torch.ones(3, dtype=torch.int64), torch.zeros(3)
    assert torch.allclose(cal.predict(depth, conf, ent), conf)
    # At depth 2 the draft is twice as confident as it should be.
    g = torch.Generator().manual_seed(0)
    c = torch.full((4000,), 0.9)
    acc = torch.rand(4000, generator=g) < 0.45
    cal.update(torch.full((4000,), 2), c, torch.zeros(4000), acc)
    pred2 = float(cal.predict(torch.tensor([2]), torch.tensor([0.9]), torch.zeros(1)))
    assert abs(pred2 - float(acc.float().mean())) < 0.01
    # depth 1 has no evidence of its own: it follows the pooled ratio (the drafter is overconfident)
    pooled = float(acc.float().mean()) / 0.9
    assert torch.allclose(cal.predict(depth, conf, ent), conf * pooled, atol=0.01)
    with pytest.raises(ValueError, match="depth"):
        cal.predict(torch.tensor([0]), torch.tensor([0.5]), torch.zeros(1))


def test_calibrator_refreshes_its_predictions_every_refresh_observations() -> None:
    """Observations are folded in at once, the predictions made anew once ``refresh`` of them came."""
    one = torch.ones(1, dtype=torch.int64)

    def fed(cal: Calibrator, n: int) -> float:
        for _ in range(n):  # a drafter whose depth-1 drafts of confidence 0.5 are always rejected
            cal.update(one, torch.full((1,), 0.5), torch.zeros(1), torch.zeros(1, dtype=torch.bool))
        return float(cal.predict(1, torch.tensor([0.5]), torch.zeros(1)))

    lazy = Calibrator(CalibrationOptions(prior_strength=4.0, decay=1.0, refresh=8))
    assert fed(lazy, 0) == pytest.approx(0.5)
    assert fed(lazy, 7) == pytest.approx(0.5)  # 7 of 8: the grid of no evidence still stands
    after = fed(lazy, 1)
    eager = Calibrator(CalibrationOptions(prior_strength=4.0, decay=1.0, refresh=1))
    assert fed(eager, 1) < 0.5 and after == pytest.approx(fed(eager, 7)) and after < 0.2


def _rank_table(rates_by_depth: list[list[float]], bins: int = 4) -> AcceptanceTable:
    """A table whose acceptance depends on depth and rank only."""
    acc = torch.tensor(rates_by_depth)[:, :, None].expand(-1, -1, bins).contiguous()
    return AcceptanceTable(acc, torch.full(acc.shape, 100))


def test_acceptance_table_lookup_shrinkage_and_json(tmp_path) -> None:
    hits = torch.zeros(2, 3, 4)
    counts = torch.zeros(2, 3, 4)
    counts[0, 0, 3], hits[0, 0, 3] = 1000, 900  # depth 1, rank 0, confident: 0.9
    counts[0, 0, 0], hits[0, 0, 0] = 2, 0  # a sparse cell follows its rank's rate
    counts[1, 2, 1], hits[1, 2, 1] = 50, 5
    t = AcceptanceTable.from_counts(hits, counts, "synthetic", strength=20.0)
    assert abs(float(t.lookup(torch.tensor(1), torch.tensor(0), torch.tensor(0.99))) - (900 + 20 * 900 / 1002) / 1020) < 1e-5
    sparse = float(t.lookup(torch.tensor(1), torch.tensor(0), torch.tensor(0.1)))
    assert 0.8 < sparse < 0.9  # 2 misses against 20 pseudo-observations at the rank's 0.898
    # deeper depths and lower ranks than the table holds use its last depth / rank
    assert float(t.lookup(torch.tensor(9), torch.tensor(7), torch.tensor(0.3))) == float(t.acceptance[1, 2, 1])
    t.save(tmp_path / "a.json")
    back = AcceptanceTable.load(tmp_path / "a.json")
    assert torch.allclose(back.acceptance, t.acceptance, atol=1e-5) and torch.equal(back.counts, t.counts)
    (tmp_path / "bad.json").write_text('{"shape": [2, 3], "acceptance": [1], "counts": [1]}')
    with pytest.raises(ValueError, match="bad.json"):
        AcceptanceTable.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="\\[0, 1\\]"):
        AcceptanceTable(torch.full((1, 1, 1), 1.5), torch.ones(1, 1, 1, dtype=torch.int64))


def test_acceptance_table_with_confidence_edges(tmp_path) -> None:
    # bins [0, 0.01), [0.01, 0.1), [0.1, 1]: low confidences get bins of their own
    acc = torch.tensor([0.005, 0.05, 0.6]).reshape(1, 1, 3)
    t = AcceptanceTable(acc, torch.full((1, 1, 3), 100), "synthetic", edges=(0.01, 0.1))
    conf = torch.tensor([0.0, 0.009, 0.01, 0.05, 0.099, 0.1, 1.0])
    assert t.confidence_bin(conf).tolist() == [0, 0, 1, 1, 1, 2, 2]
    assert t.lookup(torch.ones(7), torch.zeros(7), conf).tolist() == pytest.approx([0.005] * 2 + [0.05] * 3 + [0.6] * 2)
    t.save(tmp_path / "e.json")
    assert AcceptanceTable.load(tmp_path / "e.json").edges == (0.01, 0.1)
    assert AcceptanceTable(acc, t.counts).confidence_bin(conf).tolist() == [0, 0, 0, 0, 0, 0, 2]  # equal width
    for bad in ((0.1,), (0.1, 0.01), (0.0, 0.5), (0.5, 1.0)):
        with pytest.raises(ValueError, match="edges"):
            AcceptanceTable(acc, t.counts, edges=bad)


def test_calibrator_pools_evidence_and_keeps_ranks_apart() -> None:
    """Unseen bins start from what their depth and rank, else their rank at every depth, else the
    whole drafter measured (not from the bare base), and a runner-up is not priced like a first
    choice of the same confidence."""
    cal = Calibrator(CalibrationOptions(prior_strength=4.0, decay=1.0))
    g = torch.Generator().manual_seed(0)
    n = 2000
    rank = torch.arange(n) % 2  # rank 0 accepted 90% of the time, rank 1 10%, both at confidence 0.5
    acc = torch.rand(n, generator=g) < torch.where(rank == 0, 0.9, 0.1)
    # before any evidence the estimate is the confidence (a prediction here must not leave stale
    # pooled ratios behind for the checks below)
    assert float(cal.predict(torch.tensor([5]), torch.tensor([0.3]), torch.zeros(1), torch.tensor([0]))) == pytest.approx(0.3)
    cal.update(torch.ones(n, dtype=torch.int64), torch.full((n,), 0.5), torch.zeros(n), acc, rank)
    got = cal.predict(torch.ones(2, dtype=torch.int64), torch.full((2,), 0.5), torch.zeros(2), torch.tensor([0, 1]))
    assert abs(float(got[0]) - 0.9) < 0.03 and abs(float(got[1]) - 0.1) < 0.03
    # an unseen bin of depth 1 (confidence 0.3) and an unseen depth follow their rank's pooled
    # ratio (~1.8 for rank 0, ~0.2 for rank 1); a rank never seen, the ratio over all (~1.0 here)
    for r in (0, 1):
        ratio = float(acc[rank == r].double().mean()) / 0.5
        for depth in (1, 5):
            p = float(cal.predict(torch.tensor([depth]), torch.tensor([0.3]), torch.zeros(1), torch.tensor([r])))
            assert abs(p - 0.3 * ratio) < 0.03, (r, depth, p)
    ratio = float(acc.double().mean()) / 0.5
    p = float(cal.predict(torch.tensor([5]), torch.tensor([0.3]), torch.zeros(1), torch.tensor([3])))
    assert abs(p - 0.3 * ratio) < 0.02, p
    # ... and when the drafter is underconfident everywhere, so is every new bin's estimate lifted
    sure = Calibrator(CalibrationOptions(prior_strength=4.0, decay=1.0))
    sure.update(torch.ones(n, dtype=torch.int64), torch.full((n,), 0.5), torch.zeros(n), torch.rand(n, generator=g) < 0.9)
    assert float(sure.predict(torch.tensor([6]), torch.tensor([0.4]), torch.zeros(1))) > 0.65  # 0.4 * ~1.8


def test_calibrator_with_a_table_starts_there_and_learns() -> None:
    table = _rank_table([[0.3, 0.25, 0.2], [0.5, 0.1, 0.05]])
    cal = Calibrator(CalibrationOptions(prior_strength=4.0, decay=1.0), table)
    conf = torch.tensor([0.9, 0.05, 0.05])
    depth, rank = torch.tensor([1, 1, 2]), torch.tensor([0, 2, 0])
    assert torch.allclose(cal.predict(depth, conf, torch.zeros(3), rank), torch.tensor([0.3, 0.2, 0.5]))
    # online evidence corrects the table: depth 1 rank 0 accepted 60% of the time
    n = 4000
    acc = torch.rand(n, generator=torch.Generator().manual_seed(1)) < 0.6
    cal.update(torch.ones(n, dtype=torch.int64), torch.full((n,), 0.9), torch.zeros(n), acc, torch.zeros(n, dtype=torch.int64))
    got = float(cal.predict(torch.tensor([1]), torch.tensor([0.9]), torch.zeros(1), torch.tensor([0])))
    assert abs(got - float(acc.float().mean())) < 0.01
    # the table prices ranks, so an unseen rank-2 bin of depth 1 takes depth 1's drift (x2 here),
    # while depth 2, with no evidence of its own, takes the drift over all depths (the same here)
    drift = float(acc.float().mean()) / 0.3
    got = cal.predict(torch.tensor([1, 2]), torch.full((2,), 0.05), torch.zeros(2), torch.tensor([2, 1]))
    assert torch.allclose(got, torch.tensor([0.2, 0.1]) * drift, atol=0.01)


def test_dyntree_width_follows_the_acceptance_table() -> None:
    """With a table, every node offers the table's ranks and the measured values choose: when the
    drafter's rank 3 is accepted more often than its ranks 1-2 (confidences say the opposite),
    the tree takes rank 3 before them; the entropy rule alone never looks past max_children."""
    drafter = ToyDrafter(12, 0.2, seed=4)  # flat: entropy high
    table = _rank_table([[0.5, 0.01, 0.01, 0.4, 0.01], [0.3, 0.01, 0.01, 0.01, 0.01]])
    opts = TreeOptions(max_children=2, threshold=0.0)
    tree = TreeBuilder(opts, Calibrator(opts.calibration, table)).build(0, drafter, max_nodes=3, max_depth=2)
    assert drafter.ks[0] == 5
    depth1 = {int(tree.ranks[i]) for i in tree.children(0)}
    assert depth1 == {0, 3}  # values 0.5, 0.4; then the rank-0 grandchild (0.5 * 0.3) beats ranks 1-2
    assert tree.size == 4 and int(tree.depths.max()) == 2
    assert torch.allclose(tree.values[1:].sort(descending=True).values, torch.tensor([0.5, 0.4, 0.15]), atol=1e-6)
    plain = ToyDrafter(12, 0.2, seed=4)
    untabled = TreeBuilder(opts).build(0, plain, max_nodes=3, max_depth=2)
    assert plain.ks[0] == 2 and 3 not in untabled.ranks.tolist()


def test_candidates_per_node_lets_the_values_choose_the_width() -> None:
    """A confident node gets one child under the entropy rule; offered every candidate (a drafter
    whose candidates are few, like n-gram matches) it keeps each one the values allow."""
    opts = TreeOptions(max_children=4, entropy_low=0.3, entropy_high=2.0, threshold=0.05)
    rule = ToyDrafter(32, 6.0, seed=1)
    narrow = TreeBuilder(opts).build(0, rule, max_nodes=16, max_depth=1)
    offered = ToyDrafter(32, 6.0, seed=1)
    wide = TreeBuilder(opts, candidates_per_node=6).build(0, offered, max_nodes=16, max_depth=1)
    p = offered.dist([0]).sort(descending=True).values
    assert entropy(p) < 0.3 + (2.0 - 0.3) / 6 and len(narrow.children(0)) == 1  # k(H) = 1
    assert offered.ks == [6] and len(wide.children(0)) == int((p[:6] >= 0.05).sum()) > 1
    with pytest.raises(ValueError, match="candidates_per_node must be >= 1"):
        TreeBuilder(opts, candidates_per_node=0)


def test_calibrator_observe_judges_only_reached_nodes() -> None:
    tree = TreeBuilder(TreeOptions(threshold=0.0, max_children=3)).build(
        0, ToyDrafter(8, 0.5, seed=1), max_nodes=10, max_depth=3
    )
    accepted = tree.path(max(tree.children(tree.children(0)[0])))  # root -> first child -> a child
    cal = Calibrator()
    judged = cal.observe(tree, accepted)
    reached = set(accepted)
    want = sum(1 for i in range(1, tree.size) if int(tree.parents[i]) in reached)
    assert judged == want == cal.observations
    with pytest.raises(ValueError, match="node_entropy"):
        Calibrator().observe(DraftTree.chain(1, [2, 3]), [0, 1])


def test_options_validate_and_name_fields() -> None:
    with pytest.raises(ValidationError, match="max_nodes"):
        TreeOptions(max_nodes=-1)
    with pytest.raises(ValidationError, match="bogus"):
        TreeOptions(bogus=1)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="entropy_high"):
        TreeOptions(entropy_low=2.0, entropy_high=1.0)
    with pytest.raises(ValidationError, match="prefix"):
        TreeOptions(static_shape=((0, 0), (0,)))
    with pytest.raises(ValidationError, match="max_depth"):
        ControllerOptions(max_nodes=4, max_depth=8)
    with pytest.raises(ValidationError, match="entropy_edges"):
        CalibrationOptions(entropy_edges=(2.0, 1.0))
    TreeOptions(static_shape=((0,), (1,), (0, 0)))


@pytest.mark.parametrize("vocab,k", [(49152, 1), (49152, 4), (49152, 10), (8192, 4), (8192, 5), (1000, 4)])
def test_topk_rows_equals_torch_topk(vocab: int, k: int) -> None:
    # the two-stage top-k (block maxima, then the k best blocks) against torch.topk, on rows whose
    # best entries share a block or sit in the last one; (8192, 5) and (1000, 4) take the fallback
    from dyntree.common.drafter import topk_rows

    g = torch.Generator().manual_seed(vocab + k)
    x = torch.randn(6, vocab, generator=g)
    x[1, 7:7 + k] += 10.0  # all of them in the first block
    x[2, -k:] += 10.0  # in the last block
    x[3] = torch.log_softmax(x[3] * 8, -1).exp()  # peaked probabilities
    values, ids = topk_rows(x, k)
    ref = torch.topk(x, k, dim=-1)
    assert torch.equal(values, ref.values) and torch.equal(ids, ref.indices)


def test_top_candidates_probs_and_entropy_match_softmax() -> None:
    # greedy candidates: probabilities and entropy from log_softmax agree with softmax and entropy()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 49152, generator=g) * 4
    logits[2] = float("-inf")  # a dead row: no candidates, zero entropy
    cand = top_candidates(logits, 4)
    probs = torch.softmax(logits[:2], -1)
    ref = torch.topk(probs, 4, dim=-1)
    assert torch.equal(cand.ids[:2], ref.indices)
    torch.testing.assert_close(cand.probs[:2], ref.values)
    torch.testing.assert_close(cand.entropy[:2], entropy(probs), rtol=1e-5, atol=1e-5)
    assert float(cand.probs[2].sum()) == 0.0 and float(cand.entropy[2]) == 0.0
    some_inf = logits[:1].clone()
    some_inf[0, :100] = float("-inf")  # tokens the drafter rules out: still a finite entropy
    assert torch.isfinite(top_candidates(some_inf, 4).entropy).all()
    broken = logits[:1].clone()
    broken[0, 7] = float("nan")  # a NaN logit is not a dead row: it stays NaN and the builder refuses it
    for with_entropy in (True, False):
        with pytest.raises(ValueError, match="no NaN"):
            TreeBuilder._check(0, top_candidates(broken, 4, with_entropy=with_entropy), 1, None, False)
    # without entropies (trees that read none): the same candidates, dead rows too; dyntree refuses them
    bare = top_candidates(logits, 4, with_entropy=False)
    assert bare.entropy is None and torch.equal(bare.ids, cand.ids) and torch.equal(bare.probs[2], cand.probs[2])
    torch.testing.assert_close(bare.probs, cand.probs)
    assert TreeBuilder._check(0, bare, 3, None, False).ents is None
    with pytest.raises(ValueError, match="need the rows' entropies"):
        TreeBuilder._check(0, bare, 3, None, True)
