"""The shipped Hydra heads on the real SmolLM2 (fp32): they load, refuse another target, and
greedy Hydra drafting through the engine reproduces plain greedy decoding token for token."""

from __future__ import annotations

import json

import pytest
import torch

from dyntree.common.config import SamplingParams, SpecConfig
from dyntree.common.drafters import make_drafter
from dyntree.common.drafters.hydra import SHIPPED_HEADS, HydraDrafter
from dyntree.common.hydra import HydraMismatchError
from dyntree.common.hydra_checkpoint import load_acceptance
from dyntree.standalone.engine import SpecEngine
from dyntree.standalone.target import make_hf_drafter

pytestmark = pytest.mark.slow


def test_shipped_checkpoint_format() -> None:
    cfg = json.loads((SHIPPED_HEADS / "config.json").read_text())
    assert cfg["format"] == "dyntree-hydra" and cfg["dtype"] == "float16"
    assert cfg["target"]["hidden_size"] == 576 and cfg["target"]["vocab_size"] == 49152
    assert "train-heads" in cfg["training"]["command"]
    assert (SHIPPED_HEADS / "model.safetensors").stat().st_size <= 40 * 10**6  # issue 14: package data <= 50 MB
    table = load_acceptance(SHIPPED_HEADS)  # the measured calibration of the dynamic tree ships too
    assert table is not None and table.acceptance.shape[0] == cfg["num_heads"] and "never saw" in table.source
    assert table.edges is not None  # fine confidence bins below 0.1


def test_shipped_heads_refuse_another_target(smol) -> None:
    from spec_support import tiny_llama

    _, tok = smol
    with pytest.raises(HydraMismatchError, match="hidden size mismatch"):
        make_hf_drafter("hydra", tiny_llama(), tok)


def test_hydra_greedy_equals_plain(smol, smol_prompts) -> None:
    model, tok = smol
    drafter = make_hf_drafter("hydra", model, tok)
    assert isinstance(drafter, HydraDrafter) and drafter.needs_hidden
    prompts = smol_prompts[:2]
    params = SamplingParams(max_new_tokens=24)
    spec = SpecConfig(drafter="hydra", max_nodes=16, max_depth=4)
    plain = SpecEngine(model, tok, make_drafter("none"), spec).generate(prompts, params)
    with torch.inference_mode():
        out = SpecEngine(model, tok, drafter, spec).generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    tau = sum(o.step_tokens for o in out) / sum(o.steps for o in out)
    assert tau > 1.1, tau  # the heads really drafted accepted tokens
    assert max(len(o.accepted_per_depth) for o in out) >= 2


def test_prefix_attention_heads_greedy_equal_plain(smol, smol_prompts) -> None:
    """The shipped heads' prefix layer with its weights perturbed on SmolLM2: the drafter's own
    (beam) trees and builder trees reproduce plain greedy decoding (verification makes any draft
    lossless), and the per-request prefix state is released."""
    model, tok = smol
    heads = make_hf_drafter("hydra:int8=off", model, tok).heads  # fp32 weights, to perturb
    assert heads.prefix is not None  # the shipped heads are Hydra++ heads
    torch.manual_seed(0)
    with torch.no_grad():  # a layer unlike the trained one: the heads' input really changes
        heads.prefix.o_proj.weight.add_(torch.randn_like(heads.prefix.o_proj.weight) * 0.02)
        heads.prefix.down.weight.add_(torch.randn_like(heads.prefix.down.weight) * 0.02)
    prompts = smol_prompts[2:4]
    params = SamplingParams(max_new_tokens=24)
    plain = SpecEngine(model, tok, make_drafter("none")).generate(prompts, params)
    for tree in (None, "dyntree"):
        drafter = HydraDrafter(heads)
        spec = SpecConfig(drafter="hydra", max_nodes=16, max_depth=4, tree=tree)
        out = SpecEngine(model, tok, drafter, spec).generate(prompts, params)
        assert [o.token_ids for o in out] == [o.token_ids for o in plain], tree
        assert sum(o.draft_nodes for o in out) > 0 and not drafter._state
