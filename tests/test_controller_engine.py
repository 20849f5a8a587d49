"""The adaptive controller inside the engine (tiny random Llama; fast).

With a cost model that says a forward costs in proportion to its query tokens, speculation can
never pay: the engine must decode plainly (root-only trees, tau 1) and match plain greedy output.
With a flat cost model it must speculate and still match. The start-up cost model is measured
once per engine and kept.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from spec_support import tiny_llama
from dyntree.common.config import SamplingParams, SpecConfig
from dyntree.common.cost_model import CostModel
from dyntree.common.drafter import NoDrafter
from dyntree.common.drafters import make_drafter
from dyntree.models import model_path
from dyntree.standalone.engine import SpecEngine
from test_engine_tiny import _prompts

PARAMS = SamplingParams(max_new_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(model_path("smollm2"))


#: No outcome check: these tests force a decision through a frozen cost model, and the measured
#: tokens per ms of this machine's steps must not overrule it.
FROZEN = {"outcome_ema": 0.0}


@pytest.fixture(scope="module")
def setup(tok):
    model = tiny_llama(1)
    prompts = _prompts(1, 3)
    plain = [o.token_ids for o in SpecEngine(model, tok, make_drafter("none")).generate(prompts, PARAMS)]
    return model, prompts, plain


@pytest.mark.parametrize("tree", [None, "dyntree"])
def test_proportional_cost_falls_back_to_plain_decoding(tok, setup, tree) -> None:
    model, prompts, plain = setup
    proportional = CostModel({1: 10.0, 64: 640.0}, lr=0.0)  # lr 0: keep the forced model
    eng = SpecEngine(model, tok, make_drafter("ngram"), SpecConfig(tree=tree, adaptive=True, controller=FROZEN),
                     cost_model=proportional)
    outs = eng.generate(prompts, PARAMS)
    assert [o.token_ids for o in outs] == plain
    assert all(o.draft_nodes == 0 and o.tau == 1.0 for o in outs)
    assert eng.speculator.stats.expand_s == 0.0  # the drafter was not even asked


@pytest.mark.parametrize("tree", [None, "chain", "dyntree"])
def test_flat_cost_speculates_and_stays_lossless(tok, setup, tree) -> None:
    model, prompts, plain = setup
    # Frozen and verify-dominated, so the drafting cost learned from this machine's clock cannot decide.
    flat = CostModel({1: 1000.0, 64: 1050.0, 1024: 1200.0}, lr=0.0)
    eng = SpecEngine(model, tok, make_drafter("ngram"), SpecConfig(tree=tree, adaptive=True, controller=FROZEN),
                     cost_model=flat)
    outs = eng.generate(prompts, PARAMS)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.draft_nodes for o in outs) > 0
    assert sum(o.steps for o in outs) < sum(len(p) for p in plain)  # fewer forwards than tokens
    if tree == "chain":  # chain mode allows the controller chains only
        assert all(len(o.accepted_per_depth) <= SpecConfig().max_depth for o in outs)


def test_cost_model_measured_once_per_engine(tok, setup) -> None:
    model, prompts, _ = setup
    eng = SpecEngine(model, tok, make_drafter("ngram"), SpecConfig(adaptive=True))
    cost = eng.measure_cost(sizes=(1, 8), kv_len=16, repeats=1)
    # Timings only: their order is this machine's clock (one repeat on a shared CI machine can time
    # 8 rows below 1), which tests do not assert.
    assert cost.xs == [1, 8] and all(0 < y < float("inf") for y in cost.ys)
    eng2 = SpecEngine(model, tok, make_drafter("ngram"), SpecConfig(adaptive=True), cost_model=cost)
    assert eng2.prepare() >= 0.0 and eng2.speculator.controller is not None and eng2.speculator.controller.cost is cost
    assert eng2.prepare() == 0.0  # set up once
    eng2.generate(prompts[:1], SamplingParams(max_new_tokens=4))
    assert eng2.speculator.controller.cost is cost  # kept across generate calls
    plain = SpecEngine(model, tok, make_drafter("ngram"))
    assert plain.prepare() == 0.0 and plain.speculator.controller is None


def test_spec_config_errors_name_the_field(tok) -> None:
    with pytest.raises(ValidationError, match="tree"):
        SpecConfig(tree="bushy")
    with pytest.raises(ValidationError, match="tree_options.mode"):
        SpecConfig(tree_options={"mode": "chain"})
    with pytest.raises(ValidationError, match="controller.max_nodes"):
        SpecConfig(controller={"max_nodes": 64})
    with pytest.raises(ValidationError, match="threshold"):
        SpecConfig(tree_options={"threshold": 2.0})
    with pytest.raises(ValueError, match="tree='static'.*expand"):
        SpecEngine(tiny_llama(0), tok, NoDrafter(), SpecConfig(tree="static"))
    spec = SpecConfig(tree="chain", max_nodes=4, max_depth=8, adaptive=True)
    assert spec.budget.max_depth == 4 and not spec.controller_options().allow_trees
