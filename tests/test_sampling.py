"""Proofs that tree sampling is lossless: exhaustive enumeration on toy models, a chi-square
test at a fixed seed, and the logits processing shared by target and draft."""

from __future__ import annotations

import itertools
import random
from collections import Counter
import pytest
import torch

from dyntree.common.sampling import node_outcomes, process_logits, sample_verify
from dyntree.common.tree import DraftTree

Ctx = tuple[int, ...]


def _toy_dist(ctx: Ctx, vocab: int, salt: int, zeros: int = 0) -> torch.Tensor:
    """A fixed, context-dependent distribution (a toy 'model'), optionally with zero entries."""
    g = torch.Generator().manual_seed(hash((salt,) + ctx) % (2**31))
    w = torch.rand(vocab, generator=g, dtype=torch.float64) ** 2 + 0.02
    if zeros:
        w[torch.randperm(vocab, generator=g)[:zeros]] = 0.0
    return w / w.sum()


def target(ctx: Ctx, vocab: int) -> torch.Tensor:
    return _toy_dist(ctx, vocab, salt=1, zeros=1 if len(ctx) % 2 else 0)


def draft(ctx: Ctx, vocab: int) -> torch.Tensor:
    return _toy_dist(ctx, vocab, salt=2)


def plain_dist(ctx: Ctx, length: int, vocab: int) -> dict[Ctx, float]:
    """Exact distribution of ``length`` tokens sampled autoregressively from the target."""
    out: dict[Ctx, float] = {(): 1.0}
    for _ in range(length):
        nxt: dict[Ctx, float] = {}
        for seq, pr in out.items():
            p = target(ctx + seq, vocab)
            for y in range(vocab):
                if p[y] > 0:
                    nxt[seq + (y,)] = nxt.get(seq + (y,), 0.0) + pr * float(p[y])
        out = nxt
    return out


def draw_prob(q: torch.Tensor, toks: Ctx, scheme: str) -> float:
    """Probability that a drafter drew ``toks`` (in order) from ``q`` under ``scheme``."""
    pr, left = 1.0, q.clone()
    for x in toks:
        mass = float(left.sum())
        if mass <= 0 or left[x] <= 0:
            return 0.0
        pr *= float(left[x]) / mass
        if scheme == "without_replacement":
            left[x] = 0.0
    return pr


def spec_dist(
    parents: list[int], tokens: list[int], ctx: Ctx, length: int, vocab: int, scheme: str, stochastic: bool
) -> dict[Ctx, float]:
    """Exact distribution of the first ``length`` committed tokens: one tree verification
    (probabilities from the library's ``node_outcomes``) followed by plain target sampling."""
    kids: dict[int, list[int]] = {i: [] for i in range(len(parents))}
    for i, par in enumerate(parents[1:], start=1):
        kids[par].append(i)
    out: dict[Ctx, float] = {}

    def add_plain(prefix: Ctx, pr: float) -> None:
        for seq, pq in plain_dist(ctx + prefix, length - len(prefix), vocab).items():
            out[prefix + seq] = out.get(prefix + seq, 0.0) + pr * pq

    def walk(node: int, prefix: Ctx, pr: float) -> None:
        here = ctx + prefix
        q = draft(here, vocab) if stochastic and kids[node] else None
        outcome, residual = node_outcomes(target(here, vocab), [tokens[c] for c in kids[node]], q, scheme)
        for j, c in enumerate(kids[node]):
            if outcome[j] > 0:
                walk(c, prefix + (tokens[c],), pr * float(outcome[j]))
        for y in range(vocab):
            if outcome[-1] * residual[y] > 0:
                add_plain(prefix + (y,), pr * float(outcome[-1] * residual[y]))

    walk(0, (), 1.0)
    return out


def depth_of(parents: list[int]) -> int:
    d = [0] * len(parents)
    for i in range(1, len(parents)):
        d[i] = d[parents[i]] + 1
    return max(d)


def tv(a: dict[Ctx, float], b: dict[Ctx, float]) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def stochastic_mixture(parents: list[int], ctx: Ctx, vocab: int, draft_scheme: str, verify_scheme: str) -> dict[Ctx, float]:
    """Output distribution averaged exhaustively over every way the drafter can fill the tree."""
    length = depth_of(parents) + 1
    kids: dict[int, list[int]] = {i: [] for i in range(len(parents))}
    for i, par in enumerate(parents[1:], start=1):
        kids[par].append(i)
    total: dict[Ctx, float] = {}
    for toks in itertools.product(range(vocab), repeat=len(parents) - 1):
        tokens = [0, *toks]
        pr = 1.0
        for node in range(len(parents)):
            if kids[node]:
                here = ctx + tuple(tokens[i] for i in _path(parents, node)[1:])
                pr *= draw_prob(draft(here, vocab), tuple(tokens[c] for c in kids[node]), draft_scheme)
            if pr == 0.0:
                break
        if pr == 0.0:
            continue
        for seq, ps in spec_dist(parents, tokens, ctx, length, vocab, verify_scheme, True).items():
            total[seq] = total.get(seq, 0.0) + pr * ps
    return total


def _path(parents: list[int], i: int) -> list[int]:
    out = [i]
    while i > 0:
        i = parents[i]
        out.append(i)
    return out[::-1]


SHAPES = {
    "two_siblings": [-1, 0, 0],
    "chain3": [-1, 0, 1, 2],
    "wide_then_deep": [-1, 0, 0, 0, 1, 1, 4],
    "three_levels_branching": [-1, 0, 0, 1, 1, 2],
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("scheme", ["without_replacement", "iid"])
def test_stochastic_tree_is_exactly_lossless(shape: str, scheme: str) -> None:
    parents = SHAPES[shape]
    vocab = 3 if len(parents) > 5 else 4
    ctx = (1,)
    got = stochastic_mixture(parents, ctx, vocab, scheme, scheme)
    want = plain_dist(ctx, depth_of(parents) + 1, vocab)
    assert abs(sum(got.values()) - 1.0) < 1e-9
    assert tv(got, want) < 1e-9


def test_iid_scheme_handles_repeated_sibling_tokens() -> None:
    # Four i.i.d. children over a 3-token vocabulary must repeat a token; still exact.
    parents = [-1, 0, 0, 0, 0]
    got = stochastic_mixture(parents, (2,), 3, "iid", "iid")
    assert tv(got, plain_dist((2,), 2, 3)) < 1e-9


def test_scheme_mismatch_is_detected() -> None:
    # Guards the enumeration's power: verifying without-replacement drafts with the i.i.d. rule
    # is NOT lossless, and the same comparison must see it.
    parents = [-1, 0, 0, 0]
    got = stochastic_mixture(parents, (1,), 4, "without_replacement", "iid")
    assert tv(got, plain_dist((1,), 2, 4)) > 1e-3


@pytest.mark.parametrize("shape", ["two_siblings", "wide_then_deep", "three_levels_branching"])
def test_point_mass_trees_are_lossless_for_every_token_choice(shape: str) -> None:
    # Deterministic drafters: any fixed tree, repeated sibling tokens included.
    parents = SHAPES[shape]
    vocab = 3
    ctx = (0, 2)
    want = plain_dist(ctx, depth_of(parents) + 1, vocab)
    n_repeats = 0
    for toks in itertools.product(range(vocab), repeat=len(parents) - 1):
        tokens = [0, *toks]
        kids = [[tokens[c] for c in range(1, len(parents)) if parents[c] == n] for n in range(len(parents))]
        n_repeats += any(len(set(k)) < len(k) for k in kids)
        got = spec_dist(parents, tokens, ctx, depth_of(parents) + 1, vocab, "iid", stochastic=False)
        assert tv(got, want) < 1e-9, tokens
    assert n_repeats > 0


def test_node_outcomes_rejects_inconsistent_drafts() -> None:
    p = torch.tensor([0.5, 0.5, 0.0])
    q = torch.tensor([0.0, 0.5, 0.5])
    with pytest.raises(ValueError, match="zero draft probability"):
        node_outcomes(p, [0], q)
    with pytest.raises(ValueError, match="zero draft probability"):
        # A repeat cannot be drawn without replacement (the first 1 is rejected w.p. 0.6).
        node_outcomes(torch.tensor([0.5, 0.2, 0.3]), [1, 1], q, "without_replacement")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        node_outcomes(p, [5], None)
    with pytest.raises(ValueError, match="scheme"):
        node_outcomes(p, [1], q, "bogus")  # type: ignore[arg-type]


def _chi_square_pvalue(counts: Counter, probs: dict[Ctx, float], n: int) -> tuple[float, int]:
    stat, cells = 0.0, 0
    for k, pk in probs.items():
        e = pk * n
        stat += (counts.get(k, 0) - e) ** 2 / e
        cells += 1
    assert set(counts) <= set(probs), "sampled a sequence the target gives probability zero"
    df = cells - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0))), df


def _draw(rng: random.Random, probs: list[float], exclude: tuple[int, ...] = ()) -> int:
    """The test's own sampler (independent of the library): one draw, ``exclude`` removed."""
    w = [0.0 if i in exclude else pi for i, pi in enumerate(probs)]
    return rng.choices(range(len(w)), weights=w)[0]


def test_chi_square_100k_samples_without_replacement() -> None:
    """End to end, 100k times: a drafter fills root -> {a, b}, a -> c by sampling (a, b without
    replacement), ``sample_verify`` runs, plain target sampling completes 3 tokens; the counts
    must fit the target's exact 3-token distribution (64 cells)."""
    vocab, ctx, parents = 4, (3,), [-1, 0, 0, 1]
    prefixes = [()] + [(a,) for a in range(vocab)] + list(itertools.product(range(vocab), repeat=2))
    t_rows = {c: target(ctx + c, vocab).float() for c in prefixes}
    t_lists = {c: r.tolist() for c, r in t_rows.items()}
    q_rows = {c: draft(ctx + c, vocab).float() for c in prefixes[: vocab + 1]}
    q_lists = {c: r.tolist() for c, r in q_rows.items()}
    trees: dict[tuple[int, int, int], tuple[DraftTree, torch.Tensor]] = {}
    for a, b, c in itertools.product(range(vocab), repeat=3):
        if a == b:
            continue
        dists = torch.zeros(4, vocab)
        dists[0], dists[1] = q_rows[()], q_rows[(a,)]
        probs = torch.tensor([1.0, q_lists[()][a], q_lists[()][b], q_lists[(a,)][c]])
        tree = DraftTree(torch.tensor([0, a, b, c]), torch.tensor(parents), probs, dists)
        tp = torch.stack([t_rows[()], t_rows[(a,)], t_rows[(b,)], t_rows[(a, c)]])
        trees[(a, b, c)] = (tree, tp)
    rng, g = random.Random(99), torch.Generator().manual_seed(1234)
    n = 100_000
    counts: Counter = Counter()
    for _ in range(n):
        a = _draw(rng, q_lists[()])
        b = _draw(rng, q_lists[()], exclude=(a,))
        c = _draw(rng, q_lists[(a,)])
        tree, tp = trees[(a, b, c)]
        seq = tuple(sample_verify(tree, tp, g, "without_replacement").tokens)
        while len(seq) < 3:
            seq += (_draw(rng, t_lists[seq]),)
        counts[seq] += 1
    pval, df = _chi_square_pvalue(counts, plain_dist(ctx, 3, vocab), n)
    assert df > 20
    assert pval > 1e-3, f"chi-square p-value {pval:.2e} with {df} degrees of freedom"


def test_process_logits_temperature_topk_topp() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    p = process_logits(logits, 1.0)
    assert torch.allclose(p, torch.softmax(logits, -1))
    p = process_logits(logits, 0.5)
    assert torch.allclose(p, torch.softmax(logits / 0.5, -1))
    p = process_logits(logits, 1.0, top_k=2)
    assert (p[0, 2:] == 0).all() and torch.allclose(p[0, :2], torch.softmax(logits[0, :2], -1))
    full = torch.softmax(logits, -1)[0]
    # top_p just above the top token's mass keeps exactly two tokens.
    p = process_logits(logits, 1.0, top_p=float(full[0]) + 1e-3)
    assert (p[0] > 0).sum() == 2
    p = process_logits(logits, 1.0, top_p=float(full[0]) - 1e-3)
    assert (p[0] > 0).sum() == 1
    greedy = process_logits(logits, 0.0)
    assert greedy[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert torch.allclose(process_logits(logits, 0.7, 3, 0.9).sum(-1), torch.ones(1))
    for kwargs, field in (
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=1.0, top_k=-2), "top_k"),
        (dict(temperature=1.0, top_p=0.0), "top_p"),
    ):
        with pytest.raises(ValueError, match=field):
            process_logits(logits, **kwargs)  # type: ignore[arg-type]


def test_sample_verify_shapes_and_greedy_limit() -> None:
    tree = DraftTree.chain(5, [1, 2])
    with pytest.raises(ValueError, match=r"target_probs must have shape \[3, V\]"):
        sample_verify(tree, torch.ones(2, 8) / 8)
    # One-hot targets (temperature 0) that agree with the chain accept it all, then the argmax.
    tp = torch.zeros(3, 8)
    tp[0, 1] = tp[1, 2] = tp[2, 6] = 1.0
    res = sample_verify(tree, tp, torch.Generator().manual_seed(0))
    assert res.accepted_nodes == [0, 1, 2] and res.tokens == [1, 2, 6]
    tp[1, 2], tp[1, 4] = 0.0, 1.0
    res = sample_verify(tree, tp, torch.Generator().manual_seed(0))
    assert res.accepted_nodes == [0, 1] and res.tokens == [1, 4]
