"""Engine exactness on tiny random Llamas with sharpened attention (fast; runs everywhere).

Speculative greedy output must equal plain greedy output token for token, and each ablation
control (mask, positions, compaction) must make it diverge.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from spec_support import OracleDrafter, tiny_llama
from dyntree.common.config import SamplingParams, SpecConfig
from dyntree.common.drafters import make_drafter
from dyntree.models import model_path
from dyntree.standalone.engine import SpecEngine, prefill_groups


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(model_path("smollm2"))


def _prompts(seed: int, n: int, vocab: int = 49152) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # short repeated motifs make the n-gram drafter propose (and the model accept) real trees
    out = []
    for i in range(n):
        motif = torch.randint(3, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        out.append((motif * 6)[: 5 + 4 * i] + torch.randint(3, vocab, (3,), generator=g).tolist())
    return out


PARAMS = SamplingParams(max_new_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("batch", [1, 3])
def test_ngram_tree_equals_plain_greedy(tok, seed: int, batch: int) -> None:
    model = tiny_llama(seed)
    prompts = _prompts(seed, batch)
    plain = SpecEngine(model, tok, make_drafter("none")).generate(prompts, PARAMS)
    spec = SpecEngine(model, tok, make_drafter("ngram"), SpecConfig(max_nodes=12, max_depth=6)).generate(prompts, PARAMS)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.steps for o in spec) < sum(o.steps for o in plain)  # it did speculate


def _oracle_run(model, tok, prompts, refs, ablate=()):
    drafter = OracleDrafter(refs, {i: len(p) for i, p in enumerate(prompts)}, decoys=2)
    eng = SpecEngine(model, tok, drafter, SpecConfig(max_nodes=12, max_depth=6), ablate=ablate)
    return eng.generate(prompts, PARAMS)


def test_oracle_branching_trees_equal_plain_and_ablations_diverge(tok) -> None:
    model = tiny_llama(3)
    prompts = _prompts(3, 3)
    plain = [o.token_ids for o in SpecEngine(model, tok, make_drafter("none")).generate(prompts, PARAMS)]
    refs = dict(enumerate(plain))
    outs = _oracle_run(model, tok, prompts, refs)
    assert [o.token_ids for o in outs] == plain
    assert all(o.tau > 4 for o in outs)  # decoys first, truth later: the path is not nodes 0..k
    for piece in ("mask", "positions", "compaction"):
        broken = [o.token_ids for o in _oracle_run(model, tok, prompts, refs, ablate=[piece])]
        assert broken != plain, f"removing {piece} should change the output"


@pytest.mark.parametrize("drafting", [[1], [0, 1, 3]])
def test_ragged_verify_of_a_few_trees_equals_plain(tok, monkeypatch, drafting: list[int]) -> None:
    # Only some requests draft: the verify forward runs the trees back to back ([1, roots + nodes]
    # tokens, not 5 x the widest; the attention pads or splits by the calibrated timings);
    # outputs equal plain decoding, and losing the mask still breaks them.
    model = tiny_llama(3)
    with torch.no_grad():  # an LM head of its own: tied random embeddings repeat the last token forever
        model.lm_head.weight = torch.nn.Parameter(torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(0)))
    prompts = _prompts(3, 5)
    plain = [o.token_ids for o in SpecEngine(model, tok, make_drafter("none")).generate(prompts, PARAMS)]
    refs = {i: plain[i] if i in drafting else [] for i in range(5)}
    shapes: list[tuple[int, int]] = []
    forward = SpecEngine._forward

    def spy(self, tokens, positions, mask, cache, layout=None):
        if layout is not None:
            assert tokens.shape == (1, sum(layout.sizes)) and cache.layout is layout
            shapes.append((layout.batch, sum(size > 1 for size in layout.sizes)))
        return forward(self, tokens, positions, mask, cache, layout)

    monkeypatch.setattr(SpecEngine, "_forward", spy)
    outs = _oracle_run(model, tok, prompts, refs)
    assert [o.token_ids for o in outs] == plain
    assert (5, len(drafting)) in shapes  # the steps where every request was still decoding
    assert [o.token_ids for o in _oracle_run(model, tok, prompts, refs, ablate=["mask"])] != plain


def test_unknown_ablation_and_empty_prompt(tok) -> None:
    model = tiny_llama(0)
    with pytest.raises(ValueError, match="unknown ablation"):
        SpecEngine(model, tok, make_drafter("none"), ablate=["bogus"])
    with pytest.raises(ValueError, match="at least one token"):
        SpecEngine(model, tok, make_drafter("none")).generate([[1, 2], []])


def test_prefill_groups_partition_prompts_within_the_padding_slack() -> None:
    lens = [53, 64, 68, 65, 56, 210, 54, 58, 769, 40, 85, 660]
    groups = prefill_groups(lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        assert max(lens[i] for i in g) * len(g) <= 1.25 * sum(lens[i] for i in g)
    assert len(groups) < len(lens)  # similar lengths still share a forward
    assert prefill_groups([7, 7, 7, 7]) == [[0, 1, 2, 3]] and prefill_groups([]) == []


def test_grouped_prefill_equals_one_prompt_at_a_time(tok) -> None:
    # prompts of 8..40 tokens joining at once: several prefill groups, each padded to its longest
    model = tiny_llama(1)
    prompts = [p * 5 for p in _prompts(1, 4)][:4]
    prompts = [prompts[0][:8], prompts[1][:40], prompts[2][:9], prompts[3][:38]]
    assert len(prefill_groups([len(p) for p in prompts])) == 2
    eng = SpecEngine(model, tok, make_drafter("none"))
    together = [o.token_ids for o in eng.generate(prompts, PARAMS)]
    alone = [eng.generate([p], PARAMS)[0].token_ids for p in prompts]
    assert together == alone
