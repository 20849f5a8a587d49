"""The engine-neutral speculation step (:class:`~dyntree.common.speculator.Speculator`), driven
without any model: a toy target (next token a fixed function of the last two tokens) plays the
engine's forward, so every property here is the core's own.

Covers the flat ``DraftBatch`` (offsets, positions, packed ancestor bits, padded view), greedy
verification from logits or argmax, a propose/accept loop that reproduces plain greedy decoding
token for token in every tree mode, hidden-state routing, budget caps, statistics and release,
and the errors an engine gets for misuse.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence

import pytest
import torch

from dyntree.common.config import SamplingParams, SpecConfig
from dyntree.common.drafter import DraftRequest, Drafter, NoDrafter
from dyntree.common.drafters import make_drafter
from dyntree.common.drafters.qspec import QSpecDrafter
from dyntree.common.quant import parse_qspec
from dyntree.common.speculator import SpecRequest, Speculator
from dyntree.common.tree import DraftBatch, DraftTree, unpack_ancestor_bits

V = 32


def toy_next(context: Sequence[int]) -> int:
    """The toy target's greedy next token: a fixed function of the last two tokens (repetitive
    text, so the n-gram drafter finds real continuations)."""
    a, b = (context[-2] if len(context) > 1 else 0), context[-1]
    return (3 * a + 5 * b + 1) % 11


def toy_logits(batch: DraftBatch, tokens: dict[Hashable, list[int]]) -> torch.Tensor:
    """What an engine's verify forward returns: ``[N, V]`` logits, row ``i`` the distribution of
    the token after flat node ``i`` given its request's committed tokens and the node's path."""
    rows = []
    for b, (rid, tree) in enumerate(zip(batch.request_ids, batch.trees)):
        ctx = tokens[rid][:-1]  # the root is the tree's node 0
        for i in range(tree.size):
            path = tree.tokens[tree.path(i)].tolist()
            logits = torch.full((V,), -5.0)
            logits[toy_next(ctx + path)] = 5.0
            rows.append(logits)
    return torch.stack(rows)


def plain(prompt: list[int], n: int) -> list[int]:
    out = list(prompt)
    for _ in range(n):
        out.append(toy_next(out))
    return out[len(prompt) :]


def decode(sp: Speculator, prompts: dict[Hashable, list[int]], n: int, argmax: bool = False) -> dict[Hashable, list[int]]:
    """The engine loop: propose, 'forward', accept, commit (no stops), release."""
    tokens = {rid: list(p) for rid, p in prompts.items()}
    while any(len(tokens[r]) - len(prompts[r]) < n for r in tokens):
        live = [r for r in tokens if len(tokens[r]) - len(prompts[r]) < n]
        batch = sp.propose([SpecRequest(r, tokens[r]) for r in live])
        logits = toy_logits(batch, tokens)
        res = sp.accept(batch, logits.argmax(-1) if argmax else logits, forward_ms=1.0)
        for b, r in enumerate(live):
            tokens[r] += res.tokens[b]
    return {r: tokens[r][len(prompts[r]) : len(prompts[r]) + n] for r in tokens}


PROMPTS = {"a": [1, 2, 3, 4, 5, 1, 2, 3], "b": [7, 7], "c": [4]}


def test_draft_batch_is_flat_and_ragged() -> None:
    trees = [DraftTree.chain(5, [6, 7]), DraftTree.root_only(9),
             DraftTree(torch.tensor([1, 2, 3, 4]), torch.tensor([-1, 0, 0, 1]), torch.ones(4))]
    batch = DraftBatch.from_trees(["x", "y", "z"], trees)
    assert batch.qo_indptr.tolist() == [0, 3, 4, 8] and batch.num_nodes == 8 and batch.num_drafts == 5
    assert batch.tokens.tolist() == [5, 6, 7, 9, 1, 2, 3, 4]
    assert batch.parents.tolist() == [-1, 0, 1, -1, -1, 0, 0, 1]  # local indices
    assert batch.positions([10, 20, 30]).tolist() == [10, 11, 12, 20, 30, 31, 31, 32]
    assert batch.flat_index(2, [0, 1, 3]).tolist() == [4, 5, 7]
    bits = unpack_ancestor_bits(batch.tree_bits, 4)
    for b, t in enumerate(trees):
        assert torch.equal(bits[b, : t.size, : t.size], t.ancestor_mask())
    padded = batch.padded()
    assert padded.tokens.shape == (3, 4) and padded.valid.sum() == 8


@pytest.mark.parametrize("tree", [None, "chain", "static", "dyntree", "beam"])
def test_propose_accept_loop_equals_plain_greedy(tree) -> None:
    sp = Speculator(make_drafter("ngram"), SpecConfig(tree=tree, max_nodes=12, max_depth=6), vocab_size=V)
    out = decode(sp, PROMPTS, 40)
    assert out == {r: plain(p, 40) for r, p in PROMPTS.items()}
    assert sp.stats.steps < 3 * 40 and sum(sp.stats.accepted_per_depth) > 0  # it speculated
    stats = sp.release("a")
    assert stats.steps > 0 and stats.tau > 1.0 and stats.proposed >= stats.accepted > 0
    assert "a" not in sp.stats.requests and sp.release("a").steps == 0


def test_argmax_and_logits_verify_alike() -> None:
    runs = []
    for argmax in (False, True):
        sp = Speculator(make_drafter("ngram"), SpecConfig(tree="dyntree"), vocab_size=V)
        runs.append((decode(sp, PROMPTS, 24, argmax), sp.stats.steps, sp.stats.accepted_per_depth))
    assert runs[0] == runs[1]


def test_accept_result_is_what_the_kv_kernels_take() -> None:
    sp = Speculator(make_drafter("ngram"), SpecConfig(max_nodes=8, max_depth=4), vocab_size=V)
    tokens = {"a": PROMPTS["a"] + plain(PROMPTS["a"], 8)}
    batch = sp.propose([SpecRequest("a", tokens["a"])])
    res = sp.accept(batch, toy_logits(batch, tokens))
    n = int(res.accept_len[0])
    assert res.accept_index.shape == (1, batch.trees[0].size) and res.accept_index[0, 0] == 0
    assert (res.accept_index[0, n:] == -1).all() and n == len(res.tokens[0])  # drafts + bonus
    assert res.bonus == [res.tokens[0][-1]] and res.result(0).accepted_nodes == res.accepted(0)
    path = res.accepted(0)
    assert batch.trees[0].tokens[path[1:]].tolist() == res.tokens[0][:-1]
    assert res.tokens[0] == plain(tokens["a"], n)


def test_root_only_batch_accepts_the_argmax_like_a_tree() -> None:
    """Plain greedy decoding (root-only trees) takes a short path in verification; what it returns
    is what the tree path returns for the same roots: the argmax, the root kept, nothing drafted."""
    sp = Speculator(NoDrafter(), SpecConfig(drafter="none", adaptive=False), vocab_size=V)
    tokens = {rid: list(p) for rid, p in PROMPTS.items()}
    batch = sp.propose([SpecRequest(rid, t) for rid, t in tokens.items()])
    assert batch.num_nodes == batch.batch_size  # root-only
    logits = toy_logits(batch, tokens)
    res = sp.accept(batch, logits)
    assert res.tokens == [[int(x)] for x in logits.argmax(-1)] == [plain(t, 1) for t in tokens.values()]
    assert res.accept_index.tolist() == [[0]] * len(tokens) and res.accept_len.tolist() == [1] * len(tokens)
    # the same roots with one sampled request take the tree path: the greedy rows agree
    params = [SamplingParams(), SamplingParams(temperature=1.0)] + [SamplingParams()] * (len(tokens) - 2)
    mixed = sp._verify(batch, logits, params, torch.Generator().manual_seed(0))
    assert mixed.tokens[0] == res.tokens[0] and mixed.accept_index[:, :1].tolist() == res.accept_index.tolist()


def test_a_root_only_batch_takes_the_engines_own_sampled_tokens() -> None:
    """A step in which nobody drafted is plain decoding: an engine that sampled the next tokens
    itself (vLLM's sampler) hands them over as ``[N]``, sampled requests included; a tree that
    drafted still needs the logits for a sampled request."""
    sp = Speculator(NoDrafter(), SpecConfig(drafter="none", adaptive=False), vocab_size=V)
    tokens = {rid: list(p) for rid, p in PROMPTS.items()}
    hot = SamplingParams(temperature=0.9)
    batch = sp.propose([SpecRequest(rid, t, hot) for rid, t in tokens.items()])
    drawn = torch.arange(batch.batch_size) + 3
    res = sp.accept(batch, drawn)
    assert res.tokens == [[int(t)] for t in drawn] and res.accept_len.tolist() == [1] * batch.batch_size
    chain = DraftBatch.from_trees(["a"], [DraftTree.chain(tokens["a"][-1], [4, 5])])
    with pytest.raises(ValueError, match="pass logits, not argmax"):
        sp._verify(chain, torch.tensor([1, 2, 3]), [hot], None)


class Recorder(Drafter):
    """Root-only trees; records the hidden states pushed to it and its budgets."""

    name = "recorder"

    def __init__(self, needs_hidden: bool, max_depth: int | None = None) -> None:
        self.needs_hidden, self.max_depth = needs_hidden, max_depth
        self.states: list[torch.Tensor] = []
        self.starts: list[int | None] = []
        self.budgets: list[tuple[int, int]] = []

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        self.budgets += [(r.max_nodes, r.max_depth) for r in requests]
        return [DraftTree.root_only(r.root) for r in requests]

    def observe_hidden(self, request_id: Hashable, states: torch.Tensor, start: int | None = None) -> None:
        self.states.append(states)
        self.starts.append(start)


def test_hidden_states_reach_only_drafters_that_ask() -> None:
    for wants in (True, False):
        d = Recorder(wants)
        sp = Speculator(d, vocab_size=V)
        assert sp.needs_hidden is wants
        sp.observe_hidden("a", torch.ones(3, 4))
        sp.observe_hidden("a", torch.ones(2, 4), start=7)  # an engine that skipped positions says where rows start
        assert [s.shape[0] for s in d.states] == ([3, 2] if wants else [])
        assert d.starts == ([None, 7] if wants else [])


def test_budgets_are_capped_by_request_and_drafter_depth() -> None:
    d = Recorder(False, max_depth=3)
    sp = Speculator(d, SpecConfig(max_nodes=16, max_depth=8), vocab_size=V)
    sp.propose([SpecRequest("a", [1, 2]), SpecRequest("b", [3], max_nodes=5), SpecRequest("c", [4], max_nodes=0)])
    assert d.budgets == [(16, 3), (5, 3)]  # a zero budget never reaches the drafter
    d.budgets.clear()
    sp.propose([SpecRequest("a", [1, 2], remaining=3), SpecRequest("b", [3], remaining=1)])
    assert d.budgets == [(16, 2)]  # drafts past the last token would be cut; one token left: none


class Greedy(Drafter):
    """Breaks its budget: always a 3-node chain."""

    name = "greedy"

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        return [DraftTree.chain(r.root, [1, 2, 3]) for r in requests]


def test_misuse_gets_clear_errors() -> None:
    sp = Speculator(make_drafter("ngram"), vocab_size=V)
    with pytest.raises(ValueError, match="unique"):
        sp.propose([SpecRequest("a", [1]), SpecRequest("a", [2])])
    with pytest.raises(ValueError, match="no tokens"):
        sp.propose([SpecRequest("a", [])])
    batch = sp.propose([SpecRequest("a", [1, 2, 1])])
    with pytest.raises(ValueError, match=rf"\[{batch.num_nodes}, V\] logits"):
        sp.accept(batch, torch.zeros(batch.num_nodes + 1, V))
    hot = SamplingParams(temperature=1.0)
    batch = sp.propose([SpecRequest("s", [1, 2, 1], hot)])
    with pytest.raises(ValueError, match="samples; pass logits"):
        sp.accept(batch, torch.zeros(batch.num_nodes, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="broke its budget"):
        Speculator(Greedy(), SpecConfig(max_nodes=2), vocab_size=V).propose([SpecRequest("a", [1])])
    with pytest.raises(ValueError, match="tree='dyntree' needs a drafter with expand"):
        Speculator(NoDrafter(), SpecConfig(tree="dyntree"), vocab_size=V)
    with pytest.raises(ValueError, match="attach the engine's SelfDraftBackend"):
        Speculator(QSpecDrafter(parse_qspec("w4a16")), vocab_size=V)
    with pytest.raises(ValueError, match="cost model"):
        Speculator(make_drafter("ngram"), SpecConfig(adaptive=True), vocab_size=V)


def test_sampled_requests_verify_losslessly_on_the_first_token() -> None:
    """A sampled request through propose/accept: the first committed token follows the target's
    law (chi-square), with builder-drawn trees carrying their draft distributions."""
    target = torch.log(torch.tensor([0.05, 0.1, 0.15, 0.3, 0.4] + [1e-9] * (V - 5)))
    sp = Speculator(make_drafter("ngram"), SpecConfig(tree="dyntree", max_nodes=4, max_depth=2), vocab_size=V)
    g = torch.Generator().manual_seed(0)
    prompt = [1, 3, 4, 1, 3, 2, 1, 3]  # after "1 3": 4 or 2, so the draft disagrees with the target
    counts = torch.zeros(V)
    n = 3000
    for i in range(n):
        batch = sp.propose([SpecRequest(i, prompt, SamplingParams(temperature=1.0))], g)
        assert batch.trees[0].draft_dists is not None
        counts[sp.accept(batch, target.expand(batch.num_nodes, V), g).tokens[0][0]] += 1
        sp.release(i)
    p = torch.softmax(target, -1)[:5]
    chi2 = float(((counts[:5] - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 18.5  # 4 degrees of freedom, p ~ 0.001


def test_the_engines_time_between_forwards_reaches_the_controller(monkeypatch) -> None:
    """Consecutive decoding steps of as many rows: the time between their reports that neither
    the forward nor the drafting took is learned as the engine's time between forwards, that of
    a step with drafts when the step or the one before it had drafts; a gap that holds an
    unreported step (or an idle engine), or a step of another batch size, is not."""
    from dyntree.common import speculator as module
    from dyntree.common.cost_model import CostModel

    clock = [100.0]
    monkeypatch.setattr(module.time, "perf_counter", lambda: clock[0])
    sp = Speculator(make_drafter("ngram"), SpecConfig(adaptive=True, max_nodes=4, max_depth=4), vocab_size=V,
                    cost_model=CostModel({1: 10.0, 16: 20.0}))
    sp.prepare()
    assert sp.controller is not None

    def step(after_ms: float, rows: int = 2) -> None:
        clock[0] += after_ms / 1e3
        sp.observe_forward(rows, 10.0, kv_lens=[5] * rows)

    step(0.0)
    step(13.0)  # 10 ms of forward, 3 ms between
    assert sp.controller._between == {(2, False): pytest.approx(3.0)}
    step(40.0)  # 30 ms unaccounted for: a prefill step went unreported
    step(1000.0)  # an idle engine
    step(12.0, rows=1)  # another batch size: its first report
    assert sp.controller._between == {(2, False): pytest.approx(3.0)}
    step(11.0, rows=1)
    assert sp.controller._between[(1, False)] == pytest.approx(1.0)
    assert sp.controller.between_ms(1, True) == pytest.approx(1.0)  # drafted steps: the plain ones' until measured

    # steps with drafts (10 ms forward; drafting took no time on the stopped clock) and the plain
    # step after each: every span that holds drafts (their preparation, or their verification)
    # is a drafted step's, 4 ms; the plain steps' stay at 1 ms
    tokens = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
    for before_ms in (11.0, 14.0):
        step(before_ms, rows=1)
        for _ in range(20):
            batch = sp.propose([SpecRequest("a", tokens)])
            if batch.num_drafts:
                break
        assert batch.num_drafts > 0
        clock[0] += 14.0 / 1e3
        sp.accept(batch, toy_logits(batch, {"a": tokens}), forward_ms=10.0)
    step(14.0, rows=1)
    assert sp.controller._between[(1, True)] == pytest.approx(4.0)
    assert sp.controller._between[(1, False)] == pytest.approx(1.0)


def test_engine_timings_reach_the_controller() -> None:
    """An engine that times whole forwards reports them with ``observe_forward``; time its trees
    add outside the target forward (``accept(overhead_ms=...)``) is priced with the drafting, or
    per branching tree when the step has some."""
    from dyntree.common.cost_model import CostModel

    sp = Speculator(make_drafter("ngram"), SpecConfig(adaptive=True, max_nodes=4, max_depth=4), vocab_size=V,
                    cost_model=CostModel({1: 10.0, 16: 20.0}, lr=1.0))
    sp.observe_forward(4, 50.0)  # controller not built yet: ignored
    sp.prepare()
    assert sp.controller is not None
    sp.observe_forward(16, 40.0)
    assert sp.controller.cost(16) == pytest.approx(25.0)  # toward 40 ms, by at most 1.25x per forward
    # a forward of 16 one-token requests teaches the batch-16 knots, not one request's
    one_request = list(sp.controller.cost.knots(1))
    sp.observe_forward(16, 12.0, kv_lens=[0] * 16)
    assert sp.controller.cost.knots(1) == one_request and sp.controller.cost.knots(16)[-1] < 20.0
    tokens = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
    for _ in range(20):
        batch = sp.propose([SpecRequest("a", tokens)])
        if batch.num_drafts:
            break
    assert batch.num_drafts > 0
    before = sp.controller.draft_cost(int(batch.depths.max()), batch.num_drafts)
    res = sp.accept(batch, toy_logits(batch, {"a": tokens}), overhead_ms=500.0)
    assert res.tokens[0]
    assert sp.controller.draft_cost(int(batch.depths.max()), batch.num_drafts) > before + 100
    assert sp.controller.outcome_factor() == 1.0  # no forward timing: no outcome to check
    # with branching trees in the step, that time is the engine's price of a branching tree
    branchy = [5, 1, 2, 9, 5, 1, 3, 9, 5, 1]  # "5 1" went on with 2 and with 3: siblings
    sp = Speculator(make_drafter("ngram"), SpecConfig(adaptive=True, max_nodes=4, max_depth=4), vocab_size=V,
                    cost_model=CostModel({1: 10.0, 16: 10.5}, lr=1.0))
    for _ in range(20):
        batch = sp.propose([SpecRequest("b", branchy)])
        if batch.trees[0].size - 1 > batch.trees[0].max_depth:
            break
    assert batch.trees[0].size - 1 > batch.trees[0].max_depth
    sp.accept(batch, toy_logits(batch, {"b": branchy}), overhead_ms=60.0)
    assert sp.controller.branch_ms == pytest.approx(60.0)
    assert sp.controller.draft_cost(int(batch.depths.max()), batch.num_drafts) < 30.0  # the drafting alone
    # a speculative verify that took 5x what the cost model predicts: the outcome check sees it
    sp = Speculator(make_drafter("ngram"), SpecConfig(adaptive=True, max_nodes=4, max_depth=4), vocab_size=V,
                    cost_model=CostModel({1: 1000.0, 16: 1000.0}, lr=0.0))
    batch = sp.propose([SpecRequest("a", tokens)])
    assert batch.num_drafts > 0
    sp.accept(batch, toy_logits(batch, {"a": tokens}), forward_ms=5000.0)
    # (kept with steps of the shape the drafter built)
    built = batch.trees[0].size > 2 and batch.trees[0].size - 1 > batch.trees[0].max_depth
    assert sp.controller.outcome_factor(branching=built) < 1.0


def test_a_self_draft_starts_with_its_levels_priced() -> None:
    """A drafter that runs a forward per level (the int8 self-draft: half a target forward) starts
    the controller's price of a level at that share of the measured one-token forward: a fresh
    engine's first plan is not the deepest tree, as it is with drafting taken for free. An explicit
    ``draft_ms_per_depth_row`` wins."""
    from dyntree.common.controller import SpeculationController
    from dyntree.common.cost_model import CostModel
    from dyntree.common.options import ControllerOptions

    drafter = QSpecDrafter(parse_qspec("w8a16,perchannel"))
    drafter.attach(object())  # type: ignore[arg-type]  # nothing drafts here: plans only
    cost = CostModel({1: 60.0, 16: 70.0})
    spec = SpecConfig(adaptive=True, max_nodes=8, max_depth=8)
    sp = Speculator(drafter, spec, vocab_size=V, cost_model=cost)
    sp.prepare()
    assert sp.controller is not None and sp.controller.draft_cost(8, 8) == pytest.approx(0.5 * 60.0 * 8)
    free = SpeculationController(cost, spec.budget, spec.controller_options(drafter.acceptance_prior))
    assert free.plan(["a"])[0].max_depth == 8
    assert 0 < sp.controller.plan(["a"])[0].max_depth < 8
    own = SpecConfig(adaptive=True, controller=ControllerOptions(draft_ms_per_depth_row=1.0))
    sp = Speculator(drafter, own, vocab_size=V, cost_model=cost)
    sp.prepare()
    assert sp.controller is not None and sp.controller.draft_cost(1, 1) == pytest.approx(1.0)
    assert make_drafter("ngram").level_cost_share is None


def test_a_quiet_step_tells_the_controller_what_the_drafter_knows() -> None:
    """``quiet`` hands the controller each request's evidence and whether the drafter can draft
    for it (the n-gram index's longest match: 5 tokens is class 3; none, class 0 and no draft),
    so a spell can end on a longer match; a drafter that knows nothing beforehand is not asked,
    and the step's requests are not even built for it."""
    from dyntree.common.cost_model import CostModel

    seen: list[tuple] = []
    built: list[str] = []

    def quiet(ids: list, foresight: Callable[[], tuple[list | None, list | None]] | None = None) -> bool:
        available, evidence = foresight() if foresight is not None else ("not asked", "not asked")
        seen.append((ids, evidence, available))
        return True

    def requests() -> list[SpecRequest]:
        built.append("built")
        return [SpecRequest("a", [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5]), SpecRequest("b", [7, 8, 9])]

    for name in ("ngram", "none"):
        sp = Speculator(make_drafter(name), SpecConfig(adaptive=True, max_nodes=4, max_depth=4), vocab_size=V,
                        cost_model=CostModel({1: 10.0, 16: 20.0}))
        sp.prepare()
        assert sp.controller is not None
        sp.controller.quiet = quiet  # type: ignore[method-assign]
        assert sp.quiet(["a", "b"], requests)
    assert seen == [(["a", "b"], [3, 0], [True, False]), (["a", "b"], "not asked", "not asked")]
    assert built == ["built"]  # for the n-gram drafter only


def test_a_step_the_drafter_has_nothing_for_goes_without_a_plan() -> None:
    """An n-gram lookup without a match for any request: ``quiet`` says so without a plan (the
    controller's ``plan`` is not called, and neither planning's worth nor the steps toward a probe
    move); one match in the batch plans. A union with a part that cannot tell beforehand (Hydra)
    always plans."""
    from dyntree.common.cost_model import CostModel
    from dyntree.common.drafters.ngram import NgramDrafter
    from dyntree.common.drafters.union import UnionDrafter

    class Blind(NgramDrafter):  # drafts like the n-gram, but cannot tell beforehand
        can_draft = Drafter.can_draft  # type: ignore[assignment]

    def speculator(drafter: Drafter) -> Speculator:
        sp = Speculator(drafter, SpecConfig(adaptive=True, max_nodes=4, max_depth=4), vocab_size=V,
                        cost_model=CostModel({1: 10.0, 16: 20.0}))
        sp.prepare()
        return sp

    unmatched = [SpecRequest("a", [1, 2, 3]), SpecRequest("b", [7, 8, 9])]
    sp = speculator(make_drafter("ngram"))
    assert sp.controller is not None
    planned = sp.controller.plan
    sp.controller.plan = lambda *a, **k: pytest.fail("a step with nothing to draft is planned")  # type: ignore[method-assign]
    learned = (dict(sp.controller._plan_value), dict(sp.controller._plan_idle), dict(sp.controller._plain_run))
    assert sp.quiet(["a", "b"], lambda: unmatched)
    assert learned == (dict(sp.controller._plan_value), dict(sp.controller._plan_idle), dict(sp.controller._plain_run))
    sp.controller.plan = planned  # type: ignore[method-assign]
    matched = [SpecRequest("a", [1, 2, 3, 4, 1, 2, 3]), unmatched[1]]
    assert not sp.quiet(["a", "b"], lambda: matched)
    assert sp.propose(matched).trees[0].size > 1
    assert NgramDrafter().knows_availability and UnionDrafter([NgramDrafter(), NgramDrafter()]).knows_availability
    blind = UnionDrafter([NgramDrafter(), Blind()])
    assert not blind.knows_availability and not speculator(blind).quiet(["a", "b"], lambda: unmatched)


def test_a_chain_planned_for_a_drafter_with_its_own_trees_is_drafted_as_a_chain() -> None:
    """The n-gram drafter grows its own trie ("5 1" went on with 3 twice and with 2 once: two
    children, each likelier than what follows 3). Where the controller plans a chain (trees
    disallowed here), the speculator drafts the trie's likeliest path, not the branching trie the
    plan did not price."""
    from dyntree.common.cost_model import CostModel

    tokens = [5, 1, 3, 9, 7, 5, 1, 3, 8, 7, 5, 1, 2, 7, 5, 1]
    for allow_trees, chain in ((False, True), (True, False)):  # the control: a tree plan keeps the trie
        sp = Speculator(make_drafter("ngram"), SpecConfig(adaptive=True, max_nodes=6, max_depth=4,
                                                          controller={"allow_trees": allow_trees}),
                        vocab_size=V, cost_model=CostModel({1: 10.0, 16: 10.1}, lr=0.0))
        tree = sp.propose([SpecRequest("a", tokens)]).trees[0]
        assert tree.size > 2 and (tree.lead_chain == tree.size) == chain
        if chain:
            assert tree.tokens[1:3].tolist() == [3, 8]  # the likelier continuation, then its own likeliest
        else:
            assert sorted(tree.tokens[tree.parents == 0].tolist()) == [2, 3]


def test_a_drafters_catch_up_is_priced_per_position_not_as_drafting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Time a drafter reports as catching up (``pop_catch_up``: a request's first draft, or a
    resume) is learned per position, not into the drafting cost; the same time unreported is
    learned as drafting (the control). Once catch-ups of several sizes show a fixed part (the
    drafter's layer, which runs on every drafting step), that part stays in the drafting cost."""
    import types

    import dyntree.common.speculator as speculator_module
    from dyntree.common.cost_model import CostModel

    # a clock that moves only where the drafter is slow, so every learned sample is exact
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(speculator_module, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))

    def learned(reported: tuple[float, int], before: tuple[tuple[int, float], ...] = ()) -> tuple[float, float]:
        drafter = make_drafter("ngram")
        can_draft = drafter.can_draft

        def slow(*args: Any, **kwargs: Any) -> Any:
            clock.now += 0.1
            return can_draft(*args, **kwargs)

        drafter.can_draft = slow  # type: ignore[method-assign]
        drafter.pop_catch_up = lambda: reported  # type: ignore[method-assign]
        sp = Speculator(drafter, SpecConfig(adaptive=True, max_nodes=4, max_depth=4), vocab_size=V,
                        cost_model=CostModel({1: 10.0, 16: 10.5}, lr=1.0))
        sp.prepare()
        assert sp.controller is not None
        for positions, ms in before:
            sp.controller.observe_catch_up(positions, ms)
        tokens = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
        batch = sp.propose([SpecRequest("a", tokens)])
        assert batch.num_drafts > 0
        sp.accept(batch, toy_logits(batch, {"a": tokens}))
        assert sp.controller is not None
        return sp.controller.draft_cost(int(batch.depths.max()), batch.num_drafts), sp.controller.catch_ms

    assert learned((0.0, 0))[0] > 30.0
    drafting, per_position = learned((1000.0, 50))
    assert drafting < 10.0 and per_position == pytest.approx(20.0)
    # 50 ms fixed and 5 a position: of a 6-position catch-up's 80 ms (within the 100 ms the
    # step took), 30 leave the drafting sample, not all 80 as when the fixed part is not known
    whole = learned((80.0, 6))[0]
    drafting, per_position = learned((80.0, 6), ((2, 60.0), (18, 140.0), (2, 60.0), (18, 140.0)))
    assert per_position == pytest.approx(5.0) and drafting - whole == pytest.approx(50.0, abs=1.0)


@pytest.mark.parametrize("rectangular", [False, True])
def test_the_controller_prices_attention_at_the_prefix_each_engine_reads(rectangular: bool) -> None:
    # A paged engine's rows read their own prefixes (the mean); one rectangular cache (the
    # standalone engine) makes every row read the longest.
    from dyntree.common.cost_model import CostModel

    sp = Speculator(make_drafter("ngram"), SpecConfig(adaptive=True), vocab_size=V,
                    cost_model=CostModel({1: 10.0, 16: 20.0}), rectangular_kv=rectangular)
    sp.prepare()
    seen: list[int | None] = []
    plan = sp.controller.plan
    sp.controller.plan = lambda ids, kv=None, *rest: seen.append(kv) or plan(ids, kv, *rest)
    sp.propose([SpecRequest("a", list(range(11))), SpecRequest("b", list(range(101)))])
    assert seen == [100 if rectangular else 55]


def test_target_info_borrows_the_decoder_embedding_first() -> None:
    """``TargetInfo.from_model`` shares the decoder's own embedding (some engines'
    ``get_input_embeddings`` embeds token ids instead of returning the module), falls back to
    ``get_input_embeddings()``, ties the LM head when there is none, and cuts padded rows."""
    from torch import nn

    from dyntree.common.drafter import TargetInfo

    class Tok:
        def get_vocab(self) -> dict[str, int]:
            return {"a": 0, "b": 1}

    class Engine(nn.Module):  # vLLM-style: get_input_embeddings(input_ids) -> embeddings
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Module()
            self.model.embed_tokens = nn.Embedding(12, 4)
            self.lm_head = nn.Linear(4, 12, bias=False)

        def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.model.embed_tokens(input_ids)

    m = Engine()
    info = TargetInfo.from_model(m, Tok(), "e", vocab=10)
    assert info.embed.data_ptr() == m.model.embed_tokens.weight.data_ptr() and info.embed.shape == (10, 4)
    assert info.lm_head.data_ptr() == m.lm_head.weight.data_ptr() and info.vocab_size == 10

    class HF(nn.Module):  # HF-style accessor, tied LM head
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(8, 4)

        def get_input_embeddings(self) -> nn.Module:
            return self.emb

    h = HF()
    tied = TargetInfo.from_model(h, Tok(), "hf")
    assert tied.embed.data_ptr() == tied.lm_head.data_ptr() == h.emb.weight.data_ptr()
    with pytest.raises(ValueError, match="neither model.embed_tokens nor get_input_embeddings"):
        TargetInfo.from_model(nn.Linear(2, 2), Tok(), "x")
