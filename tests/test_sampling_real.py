"""Lossless sampling on the real model: with tree speculation, the first token a tree step samples
is distributed exactly as plain sampling from the target (SmolLM2-135M-Instruct, fp32).

The prompt repeats phrases, so the n-gram drafter proposes several sibling drafts (drawn without
replacement from its distribution) for the first token and the target accepts some and rejects
others: the recursive-rejection path is exercised both ways. Plain sampling's distribution is
known exactly (``process_logits`` of the target's logits), so the test is a chi-square
goodness-of-fit at a fixed seed:

* the full engine path: ``generate`` on a batch of copies of the prompt less its last token
  (the prefill samples that token back in about half the rows; in those, the first tree step
  draws the token after the prompt: each row its own tree and its own accept/reject coins), for
  a few seeds;
* many more draws of the same step from the same prefix without re-running the model: the
  engine's builder grows sampled trees from the drafter's scores and ``sample_verify`` decides
  them against the target distribution computed once.

Control: the draft's own first child fails the same test (the test has power).
"""

from __future__ import annotations

import pytest
import torch

from dyntree.common.builder import TreeBuilder
from dyntree.common.config import SamplingParams, SpecConfig
from dyntree.common.drafter import DraftRequest
from dyntree.common.drafters import make_drafter
from dyntree.common.sampling import process_logits, sample_verify
from dyntree.standalone.engine import SpecEngine
from spec_support import chi2_pvalue_ok

pytestmark = pytest.mark.slow

TEXT = "the cat sat on the mat. the dog ran to the park. the cat ran to the mat. the"
TEMP, TOP_K = 0.8, 20
# two siblings drawn from the n-gram's four candidates (cat, mat, dog, park): the target puts ~98% on
# " dog", so a tree that drew it is accepted (~80% of rows) and one that left it out is rejected
SPEC = SpecConfig(drafter="ngram", max_nodes=2, max_depth=1, tree="dyntree")


@pytest.fixture(scope="module")
def setup(smol):
    model, tok = smol
    prompt = tok(TEXT).input_ids
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    p = process_logits(logits, TEMP, TOP_K)
    return prompt, p


def test_engine_first_token_matches_plain_sampling(smol, setup) -> None:
    """The engine's prefill samples the first token; starting one token early, the first tree step
    decides the token after the whole prompt (in the ~54% of rows whose first token is the prompt's
    own last one, the rows this test reads: conditioned on it, the step's distribution is ``p``)."""
    model, tok = smol
    prompt, p = setup
    counts = torch.zeros_like(p, dtype=torch.int64)
    accepted = draws = 0
    for seed in range(4):
        eng = SpecEngine(model, tok, make_drafter("ngram"), SPEC)
        # three tokens: with only one left a step has nothing to gain from drafts and plans none
        params = SamplingParams(max_new_tokens=3, temperature=TEMP, top_k=TOP_K, seed=seed, ignore_eos=True)
        outs = [o for o in eng.generate([prompt[:-1]] * 128, params) if o.token_ids[0] == prompt[-1]]
        for o in outs:
            counts[o.token_ids[1]] += 1
            accepted += bool(o.accepted_per_depth)
            draws += 1
        # sibling drafts for that token (the first tree step; a second, if any, has one token left)
        assert all(o.draft_nodes == 2 and o.steps <= 2 for o in outs)
    assert draws >= 200, f"only {draws} rows drew the prompt's last token first"
    ok, stat, crit = chi2_pvalue_ok(counts, p)
    assert ok, f"engine first-token distribution differs from plain sampling: chi2 {stat:.1f} > {crit:.1f}"
    # both paths: a sibling accepted, and every sibling rejected (the token then drawn from the residual)
    assert accepted >= 0.1 * draws and draws - accepted >= 0.1 * draws, f"accepted a draft in {accepted}/{draws} draws"
    plain = SpecEngine(model, tok, make_drafter("none"))
    outs = plain.generate([prompt] * 96, SamplingParams(max_new_tokens=1, temperature=TEMP, top_k=TOP_K, seed=9))
    plain_counts = torch.bincount(torch.tensor([o.token_ids[0] for o in outs]), minlength=p.numel())
    assert chi2_pvalue_ok(plain_counts, p)[0]


def test_many_tree_steps_from_one_prefix(setup) -> None:
    prompt, p = setup
    drafter = make_drafter("ngram")
    builder = TreeBuilder(SPEC.tree_options)
    gen = torch.Generator().manual_seed(1234)
    n_draws, chunk = 3000, 150
    req = [DraftRequest(r, prompt, max_nodes=SPEC.max_nodes, max_depth=1) for r in range(chunk)]
    counts = torch.zeros(p.numel(), dtype=torch.int64)
    first_child = torch.zeros(p.numel(), dtype=torch.int64)

    shaping = SamplingParams(temperature=TEMP, top_k=TOP_K)  # the draft shaped like the target

    def expand(frontiers, partials, k):
        # the drafter's top-k candidates, flat over the batch, split per tree as the builder wants
        return drafter.expand(req, frontiers, partials, k, shaping).split([len(f) for f in frontiers])

    for _ in range(n_draws // chunk):
        trees = builder.build_batch([prompt[-1]] * chunk, expand, budgets=[(SPEC.max_nodes, 1)] * chunk,
                                    mode="dyntree", sampling=True, vocab_size=p.numel(), generator=gen)
        for tree in trees:
            assert tree.size >= 3 and tree.draft_dists is not None
            # depth-1 tree: rows below the root only matter after the first token is decided
            res = sample_verify(tree, p.expand(tree.size, -1), gen, SPEC.tree_options.sampling_scheme)
            counts[res.tokens[0]] += 1
            first_child[int(tree.tokens[1])] += 1
    ok, stat, crit = chi2_pvalue_ok(counts, p)
    assert ok, f"first-token distribution differs from plain sampling: chi2 {stat:.1f} > {crit:.1f}"
    assert not chi2_pvalue_ok(first_child, p)[0]  # control: the draft alone is not the target
