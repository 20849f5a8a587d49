"""Hydra heads, checkpoints, drafter and trainer on small random targets (fast, no real model)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dyntree.common.config import SpecConfig
from dyntree.common.drafter import DraftRequest
from dyntree.common.drafters.hydra import HydraDrafter, parse_hydra_options
from dyntree.common.hydra import HydraConfig, HydraHeads, HydraMismatchError, TargetIdentity
from dyntree.common.hydra_checkpoint import load_acceptance, load_heads, save_heads
from dyntree.common.speculator import Speculator, SpecRequest
from dyntree.common.calibration import CONFIDENCE_EDGES
from dyntree.kernels.cpu_weight_only import int8_available
from dyntree.training.trainer import (
    HeadData,
    TrainConfig,
    _losses,
    _teacher,
    loss_top_k,
    evaluate,
    measure_acceptance,
    reduced_token_map,
    train,
)
from dyntree.training.data import HiddenCache
from spec_support import synthetic_head_cache

D, VOCAB = 16, 97
IDENT = TargetIdentity("tiny", D, VOCAB, "ab" * 32)


def _target(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, D, generator=g), torch.randn(VOCAB, D, generator=g)


def _heads(independent: bool = False, reduced: int = 0, k: int = 3, seed: int = 0) -> HydraHeads:
    embed, lm_head = _target()
    cfg = HydraConfig(num_heads=k, num_layers=2, hidden_size=D, target=IDENT, independent=independent,
                      reduced_vocab=reduced)
    token_map = torch.arange(0, 2 * reduced, 2) if reduced else None
    heads = HydraHeads(cfg, embed, lm_head, token_map)
    torch.manual_seed(seed)
    with torch.no_grad():  # leave the near-identity init: make every input matter
        for p in heads.parameters():
            p.normal_(0.0, 0.3)
    return heads


def test_shapes_full_and_reduced_vocab() -> None:
    h, toks = torch.randn(5, D), torch.randint(0, VOCAB, (5, 3))
    assert _heads()(h, toks).shape == (5, 3, VOCAB)
    reduced = _heads(reduced=20)
    assert reduced(h, toks).shape == (5, 3, 20)
    assert reduced.to_full_ids(torch.tensor([0, 3, 19])).tolist() == [0, 6, 38]
    with pytest.raises(ValueError, match=r"shape \[5, 2\]"):
        reduced.head_logits(2, h, toks)
    with pytest.raises(HydraMismatchError, match="hidden_size=16"):
        reduced.head_logits(1, torch.randn(5, D + 1), toks[:, :1])


@pytest.mark.parametrize("independent", [False, True])
def test_sequential_dependency(independent: bool) -> None:
    """Changing head 1's chosen token changes head 2's distribution, except in the ablation."""
    heads = _heads(independent=independent)
    h = torch.randn(4, D)
    a = torch.randint(0, VOCAB, (4, 3))
    b = a.clone()
    b[:, 1] = (a[:, 1] + 1) % VOCAB  # head 1's token (the second path token)
    la, lb = heads(h, a), heads(h, b)
    assert torch.equal(la[:, 0], lb[:, 0])  # head 1 never sees its own output
    moved = (la[:, 1] - lb[:, 1]).abs().max().item()
    if independent:
        assert moved == 0.0
    else:
        assert moved > 1e-3
    c = a.clone()
    c[:, 0] = (a[:, 0] + 1) % VOCAB  # the committed root is an input in both variants
    assert (heads(h, c)[:, 1] - la[:, 1]).abs().max().item() > 1e-3


def test_save_load_round_trip(tmp_path: Path) -> None:
    heads = _heads(reduced=20, independent=True)
    save_heads(heads, tmp_path, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_heads"] == 3 and cfg["reduced_vocab"] == 20 and cfg["independent"] is True
    assert cfg["target"]["hidden_size"] == D and cfg["dtype"] == "float32"
    embed, lm_head = _target()
    back = load_heads(tmp_path, IDENT, embed, lm_head)
    assert torch.equal(back.token_map, heads.token_map)
    h, toks = torch.randn(6, D), torch.randint(0, VOCAB, (6, 3))
    assert torch.equal(back(h, toks), heads(h, toks))
    save_heads(heads, tmp_path / "fp16")  # the shipped format: fp16 weights
    half = load_heads(tmp_path / "fp16", IDENT, embed, lm_head)
    assert torch.allclose(half(h, toks), heads(h, toks), atol=0.05 * heads(h, toks).abs().max().item())


def test_wide_layers_round_trip_and_old_configs(tmp_path: Path) -> None:
    """``layer_width`` > 1 heads (``z + W_down silu(W_up z)``) save and load; a config written
    before the field existed reads as width 1; a checkpoint of another width is refused by name."""
    embed, lm_head = _target()
    cfg = HydraConfig(num_heads=2, num_layers=2, hidden_size=D, target=IDENT, layer_width=3)
    wide = HydraHeads(cfg, embed, lm_head)
    assert wide.heads[0].layers[0].up.weight.shape == (3 * D, D)
    h, toks = torch.randn(4, D), torch.randint(0, VOCAB, (4, 2))
    # at init the wide branches are zero: head k reads h_t through the identity projection
    assert torch.allclose(wide.heads[0](torch.cat([h, embed[toks[:, 0]]], 1)), h, atol=0.1)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in wide.parameters():
            p.normal_(0.0, 0.3)
    save_heads(wide, tmp_path / "wide", dtype=torch.float32)
    back = load_heads(tmp_path / "wide", IDENT, embed, lm_head)
    assert back.config.layer_width == 3 and torch.equal(back(h, toks), wide(h, toks))
    save_heads(_heads(), tmp_path / "old", dtype=torch.float32)
    old = json.loads((tmp_path / "old" / "config.json").read_text())
    del old["layer_width"]
    (tmp_path / "old" / "config.json").write_text(json.dumps(old))
    assert load_heads(tmp_path / "old", IDENT, embed, lm_head).config.layer_width == 1
    (tmp_path / "old" / "config.json").write_text(json.dumps({**old, "layer_width": 2}))
    with pytest.raises(HydraMismatchError, match="missing"):  # width-1 weights under a width-2 config
        load_heads(tmp_path / "old", IDENT, embed, lm_head)
    with pytest.raises(HydraMismatchError, match="layer_width must be a positive int"):
        HydraConfig(num_heads=1, num_layers=1, hidden_size=D, target=IDENT, layer_width=0)


@pytest.mark.parametrize(
    "field,value,message",
    [("hidden_size", D + 8, "hidden size mismatch"), ("vocab_size", VOCAB + 1, "vocabulary mismatch"),
     ("tokenizer_sha256", "cd" * 32, "tokenizer mismatch")],
)
def test_mismatch_errors_name_the_dimension(tmp_path: Path, field: str, value: object, message: str) -> None:
    save_heads(_heads(), tmp_path)
    other = TargetIdentity(**{**IDENT.__dict__, field: value})
    embed, lm_head = _target()
    with pytest.raises(HydraMismatchError, match=message):
        load_heads(tmp_path, other, embed, lm_head)


def test_malformed_checkpoints_are_refused(tmp_path: Path) -> None:
    save_heads(_heads(), tmp_path)
    embed, lm_head = _target()
    with pytest.raises(HydraMismatchError, match="embedding has 96 rows"):
        load_heads(tmp_path, IDENT, embed[:-1], lm_head)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_heads": 4}))
    with pytest.raises(HydraMismatchError, match="missing"):
        load_heads(tmp_path, IDENT, embed, lm_head)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "format": "medusa"}))
    with pytest.raises(HydraMismatchError, match="'format'"):
        load_heads(tmp_path, IDENT, embed, lm_head)
    with pytest.raises(HydraMismatchError, match="duplicate"):
        HydraHeads(HydraConfig(num_heads=1, num_layers=1, hidden_size=D, target=IDENT, reduced_vocab=2),
                   embed, lm_head, torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="no config.json"):
        parse_hydra_options(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="option 'depth' is unknown"):
        parse_hydra_options(f"{tmp_path},depth=3")
    with pytest.raises(ValueError, match="table='maybe'"):
        parse_hydra_options(f"{tmp_path},table=maybe")
    assert parse_hydra_options(f"{tmp_path},table=off").table is False
    with pytest.raises(ValueError, match="int8='yes'"):
        parse_hydra_options(f"{tmp_path},int8=yes")
    assert [parse_hydra_options(f"{tmp_path}{o}").int8 for o in ("", ",int8=on", ",int8=off")] == [None, True, False]
    assert [parse_hydra_options(f"{tmp_path}{o}").context for o in ("", ",context=0", ",context=200")] == [64, 0, 200]
    with pytest.raises(ValueError, match="context must be >= 0, got -1"):
        parse_hydra_options(f"{tmp_path},context=-1")


def test_reduced_token_map_picks_most_frequent() -> None:
    counts = np.array([5, 0, 9, 9, 1, 7])
    assert reduced_token_map(counts, 3).tolist() == [2, 3, 5]
    assert reduced_token_map(counts, 4).tolist() == [0, 2, 3, 5]
    with pytest.raises(ValueError, match="--vocab-size 7"):
        reduced_token_map(counts, 7)


class _Counting(HydraHeads):
    """Counts head forwards (the drafter must run one batched forward per depth)."""

    calls: list[tuple[int, int]]

    def head_logits(self, k, hidden, path):  # type: ignore[override]
        self.calls.append((k, hidden.shape[0]))
        return super().head_logits(k, hidden, path)


def _counting_heads(k: int = 3) -> _Counting:
    base = _heads(k=k, reduced=40)
    heads = _Counting(base.config, *_target(), base.token_map)
    heads.load_state_dict(base.state_dict())
    heads.calls = []
    return heads


def _speculator(drafter: HydraDrafter, max_nodes: int, max_depth: int) -> Speculator:
    """Hydra's own (``beam``) trees through the public speculation API."""
    return Speculator(drafter, SpecConfig(max_nodes=max_nodes, max_depth=max_depth), vocab_size=VOCAB)


@pytest.mark.parametrize("max_nodes,max_depth", [(16, 8), (5, 2), (1, 1), (9, 3)])
def test_drafter_respects_budget_and_batches_per_depth(max_nodes: int, max_depth: int) -> None:
    heads = _counting_heads(k=3)
    drafter = HydraDrafter(heads)
    sp = _speculator(drafter, max_nodes, max_depth)
    reqs = [SpecRequest(i, [1, 2, 3 + i]) for i in range(3)]
    for r in reqs:  # positions 0 .. kv_len - 1 (the tokens before the root)
        sp.observe_hidden(r.request_id, torch.randn(len(r.token_ids) - 1, D))
    reqs.append(SpecRequest(9, [4]))  # no hidden: no speculation
    trees = sp.propose(reqs).trees
    assert [t.root for t in trees] == [3, 4, 5, 4]
    assert trees[3].size == 1
    depth = min(3, max_depth)
    for t in trees[:3]:
        assert t.size - 1 == max_nodes  # the budget is used, never exceeded
        assert t.max_depth <= depth
        assert bool(((t.draft_probs > 0) & (t.draft_probs <= 1)).all())
        assert all(int(x) % 2 == 0 for x in t.tokens[1:])  # reduced ids mapped back to full ids
    assert [k for k, _ in heads.calls] == list(range(1, len({int(d) for d in trees[0].depths[1:]}) + 1))
    assert heads.calls[0][1] == 3  # depth 1: the three roots in one forward


def test_drafter_children_are_the_heads_top_tokens() -> None:
    heads = _heads(k=2)
    drafter = HydraDrafter(heads, width=2, topk=2)
    sp = _speculator(drafter, 4, 4)
    h = torch.randn(D)
    sp.observe_hidden(0, h[None])  # the state at the token before the root
    tree = sp.propose([SpecRequest(0, [5, 7])]).trees[0]
    probs1 = torch.softmax(heads.head_logits(1, h[None], torch.tensor([[7]])), -1)[0]
    top = tree.children(0)  # in index order: likeliest first
    assert tree.tokens[top].tolist() == probs1.topk(2).indices.tolist()
    assert torch.allclose(tree.draft_probs[top], probs1.topk(2).values)
    first = int(tree.tokens[top[0]])
    probs2 = torch.softmax(heads.head_logits(2, h[None], torch.tensor([[7, first]])), -1)[0]
    deep = tree.children(top[0])
    assert deep  # the beam kept some of the first child's children
    assert [int(tree.tokens[i]) for i in deep] == probs2.topk(len(deep)).indices.tolist()


def test_generate_cache_is_consistent(tmp_path: Path) -> None:
    """Each cached hidden state, through the LM head, gives the next cached token."""
    from transformers import AutoTokenizer

    from spec_support import tiny_llama
    from dyntree.models import model_path
    from dyntree.training.data import generate_cache

    tok = AutoTokenizer.from_pretrained(model_path("smollm2"))
    model = tiny_llama(seed=3)
    prompts = ["Name a river.", "Write a haiku about the sea, please.", "What is 2 + 2?"]
    cache = generate_cache(model, tok, prompts, tmp_path / "cache", batch_size=2, max_new_tokens=8)
    assert cache.meta["sequences"] == 3 and cache.hidden_size == 64
    plens = cache.prompt_lens.tolist()
    assert cache.offsets.tolist() == np.cumsum([0] + [p + 8 for p in plens]).tolist()  # prompt + 8 generated
    assert cache.meta["response_tokens"] == 3 * 9  # the last prompt token + 8 generated, per sequence
    h = torch.from_numpy(np.asarray(cache.hidden, dtype=np.float32))
    logits = h @ model.lm_head.weight.T
    nxt = logits.argmax(-1)
    for s, e, p in zip(cache.offsets[:-1], cache.offsets[1:], plens):
        r = s + p - 1  # the last prompt token: its state produced the first response token
        assert nxt[r:e - 1].tolist() == cache.tokens[r + 1:e].tolist()
        assert not h[e - 1].any()  # the last row produced nothing
        # the prompt rows are the target's own states over the prompt (teacher-forced, unpadded)
        ids = torch.from_numpy(cache.tokens[s:s + p].astype(np.int64))[None]
        with torch.no_grad():
            ref = model(ids).logits[0]
        assert torch.allclose(logits[s:r + 1], ref, atol=2e-2), (logits[s:r + 1] - ref).abs().max()
    pos, valid = cache.positions(3)
    r0 = plens[0] - 1
    assert pos[:8].tolist() == list(range(r0, r0 + 7)) + [plens[0] + 8 + plens[1] - 1]
    assert valid[:7].tolist() == [3, 3, 3, 3, 3, 2, 1]


def test_grouped_attention_equals_sdpa() -> None:
    """The generation-time attention (K/V shared by query groups, no repeat) gives sdpa's logits on a
    left-padded GQA batch, over the prefill and over cached decode steps."""
    import dyntree.training.data  # noqa: F401  (registers the attention)

    from spec_support import tiny_llama

    model = tiny_llama(seed=5)
    ids = torch.randint(3, 1000, (3, 12))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[2, :2] = 0
    out = {}
    for impl in ("sdpa", "dyntree_grouped"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            first = model(ids, attention_mask=mask, use_cache=True)
            nxt = first.logits[:, -1:].argmax(-1)
            step = model(nxt, attention_mask=torch.cat([mask, torch.ones_like(nxt)], 1),
                         past_key_values=first.past_key_values, use_cache=True)
        out[impl] = (first.logits[mask.bool()], step.logits)
    for a, b in zip(out["sdpa"], out["dyntree_grouped"]):
        assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()


def _synthetic_cache(path: Path, seed: int = 0):
    return synthetic_head_cache(path, VOCAB, D, [30] * 24, seed)


def test_generate_cache_time_budget_and_resume(tmp_path: Path) -> None:
    """A spent budget stops after one batch and consolidates a partial cache; a budget of 0 uses
    what is there without rewriting it (training jobs side by side share one cache); a run
    without a budget completes it, with the same sequences as one go."""
    from transformers import AutoTokenizer

    from spec_support import tiny_llama
    from dyntree.models import model_path
    from dyntree.training.data import generate_cache

    tok = AutoTokenizer.from_pretrained(model_path("smollm2"))
    model = tiny_llama(seed=3)
    prompts = [f"Name river number {i}." for i in range(5)]
    part = generate_cache(model, tok, prompts, tmp_path / "c", batch_size=2, max_new_tokens=4, time_budget_s=0.0)
    assert part.meta["complete"] is False and part.meta["batches_done"] == 1 and part.meta["sequences"] in (1, 2)
    written = {f: (tmp_path / "c" / f).stat().st_mtime_ns for f in ("hidden.npy", "tokens.npy", "meta.json")}
    again = generate_cache(model, tok, prompts, tmp_path / "c", batch_size=2, max_new_tokens=4, time_budget_s=0.0)
    assert again.meta["batches_done"] == 1
    assert {f: (tmp_path / "c" / f).stat().st_mtime_ns for f in written} == written  # not consolidated again
    full = generate_cache(model, tok, prompts, tmp_path / "c", batch_size=2, max_new_tokens=4)
    assert full.meta["complete"] is True and full.meta["sequences"] == 5
    one_go = generate_cache(model, tok, prompts, tmp_path / "d", batch_size=2, max_new_tokens=4)
    assert full.tokens.tolist() == one_go.tokens.tolist() and full.prompt_lens.tolist() == one_go.prompt_lens.tolist()
    with pytest.raises(ValueError, match="other settings"):
        generate_cache(model, tok, prompts, tmp_path / "c", batch_size=3, max_new_tokens=4)


def test_generate_cache_max_batches(tmp_path: Path) -> None:
    """``max_batches`` generates the first N batches of the seeded order (the ones a full run
    consolidates first), and a larger N resumes from them."""
    from transformers import AutoTokenizer

    from spec_support import tiny_llama
    from dyntree.models import model_path
    from dyntree.training.data import generate_cache

    tok = AutoTokenizer.from_pretrained(model_path("smollm2"))
    model = tiny_llama(seed=3)
    prompts = [f"Name river number {i}." for i in range(7)]
    two = generate_cache(model, tok, prompts, tmp_path / "c", batch_size=2, max_new_tokens=4, max_batches=2)
    assert two.meta["complete"] is False and two.meta["batches_done"] == 2
    assert len(list((tmp_path / "c" / "chunks").glob("*.npz"))) == 2
    full = generate_cache(model, tok, prompts, tmp_path / "d", batch_size=2, max_new_tokens=4)
    assert full.meta["batches_done"] == 4
    assert two.tokens.tolist() == full.tokens.tolist()[:len(two.tokens)]  # the order's first two
    three = generate_cache(model, tok, prompts, tmp_path / "c", batch_size=2, max_new_tokens=4, max_batches=3)
    assert three.meta["batches_done"] == 3
    assert three.tokens.tolist() == full.tokens.tolist()[:len(three.tokens)]


def test_tiny_training_run_reduces_loss(tmp_path: Path) -> None:
    cache = _synthetic_cache(tmp_path / "cache")
    embed, lm_head = _target()
    token_map = reduced_token_map(cache.token_counts(VOCAB), 64)
    cfg = HydraConfig(num_heads=3, num_layers=1, hidden_size=D, target=IDENT, reduced_vocab=64)
    heads = HydraHeads(cfg, embed, lm_head, token_map)
    data = HeadData(cache, 3, val_fraction=0.2, seed=0, device=torch.device("cpu"))
    fixed = data.batch(data.train_pos[:256], data.train_valid[:256])
    before, val_before = _losses(heads, fixed)[0], evaluate(heads, data)["loss"]
    tcfg = TrainConfig(steps=60, batch_size=64, lr=1e-2, warmup=5, save_every=30)
    result = train(heads, data, tcfg, tmp_path / "run")
    after = _losses(heads, fixed)[0]
    assert bool((after < 0.7 * before).all()), (before, after)  # every head learned
    assert all(a < 0.7 * b for a, b in zip(result["val"]["loss"], val_before))  # also on held-out data
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").open()]
    assert len(log[0]["loss"]) == 3 and len(log[0]["top1"]) == 3
    # resuming a finished run trains no further and reproduces the same weights
    again = HydraHeads(cfg, embed, lm_head, token_map)
    train(again, data, tcfg, tmp_path / "run")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), heads.state_dict().values()))
    with pytest.raises(ValueError, match="another training config"):
        train(again, data, TrainConfig(steps=61), tmp_path / "run")


def test_distillation_losses(tmp_path: Path) -> None:
    """``hard`` learns the teacher's top-1 token only, ``topK`` its K best renormalised, ``soft`` the
    whole softmax; each trains the heads; a bad name is refused naming the forms."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    assert torch.allclose(_teacher(logits, 0), torch.softmax(logits, -1))
    assert _teacher(logits, 1).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    two = _teacher(logits, 2)
    assert torch.allclose(two[0, :2], torch.softmax(logits[0, :2], -1)) and two[0, 2:].abs().sum() == 0
    assert torch.allclose(_teacher(logits, 9), torch.softmax(logits, -1))  # K past the vocabulary: all of it
    assert [loss_top_k(x) for x in ("soft", "hard", "top8")] == [0, 1, 8]
    for bad in ("top0", "kl", "top-2", "Top8"):
        with pytest.raises(ValueError, match="loss must be soft, hard or topK"):
            TrainConfig(loss=bad)
    cache = _synthetic_cache(tmp_path / "cache")
    embed, lm_head = _target()
    token_map = reduced_token_map(cache.token_counts(VOCAB), 64)
    cfg = HydraConfig(num_heads=2, num_layers=1, hidden_size=D, target=IDENT, reduced_vocab=64)
    data = HeadData(cache, 2, val_fraction=0.2, seed=0, device=torch.device("cpu"))
    fixed = data.batch(data.train_pos[:256], data.train_valid[:256])
    trained = {}
    for loss in ("hard", "top4"):
        heads = HydraHeads(cfg, embed, lm_head, token_map)
        before = _losses(heads, fixed, loss_top_k(loss))[0]
        train(heads, data, TrainConfig(steps=60, batch_size=64, lr=1e-2, warmup=5, loss=loss), tmp_path / loss)
        after = _losses(heads, fixed, loss_top_k(loss))[0]
        assert bool((after < 0.7 * before).all()), (loss, before, after)  # every head learned its labels
        trained[loss] = heads.state_dict()
    assert not all(torch.equal(a, b) for a, b in zip(trained["hard"].values(), trained["top4"].values()))


def test_train_fraction_subsets_training_sequences_only(tmp_path: Path) -> None:
    """``train_fraction`` keeps a seeded share of the training sequences (whole sequences, a subset
    of the full set) and leaves the held-out set as it is; 1 is the full set; 0 or > 1 is refused."""
    cache = _synthetic_cache(tmp_path / "cache")  # 24 sequences, 5 held out at 0.2
    full = HeadData(cache, 3, val_fraction=0.2, seed=0, device=torch.device("cpu"))
    half = HeadData(cache, 3, val_fraction=0.2, seed=0, device=torch.device("cpu"), train_fraction=0.5)
    assert torch.equal(half.val_pos, full.val_pos)
    seqs = lambda d: set(d.train_start.tolist())  # noqa: E731
    assert len(seqs(half)) == 10 and seqs(half) < seqs(full) and len(seqs(full)) == 19
    rows = set(half.train_pos.tolist())
    assert rows < set(full.train_pos.tolist())
    assert rows == {p for p, st in zip(full.train_pos.tolist(), full.train_start.tolist()) if st in seqs(half)}
    other = HeadData(cache, 3, val_fraction=0.2, seed=1, device=torch.device("cpu"), train_fraction=0.5)
    assert seqs(other) != seqs(half)  # seeded
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="train_fraction must be in"):
            HeadData(cache, 3, val_fraction=0.2, seed=0, device=torch.device("cpu"), train_fraction=bad)


def test_prompt_positions(tmp_path: Path) -> None:
    """``prompt_positions`` adds each training sequence's prompt positions after the shared
    template header; held-out sequences keep their response positions only; a cache without the
    prompts' states is refused."""
    lens, plens = [20, 14, 25, 18, 22], [9, 6, 11, 7, 8]
    synthetic_head_cache(tmp_path / "c", VOCAB, D, lens, prompt_lens=plens)
    tokens = np.load(tmp_path / "c" / "tokens.npy")
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    for s in starts:  # a 4-token "chat template" header shared by every sequence
        tokens[s:s + 4] = [70, 71, 72, 73]
    tokens[starts[2] + 4] = tokens[starts[0] + 4]  # one sequence sharing more is not the header
    np.save(tmp_path / "c" / "tokens.npy", tokens)
    cache = HiddenCache(tmp_path / "c")
    assert cache.template_len == 4
    pos, valid = cache.positions(3, prompt=True)
    expected = np.concatenate([np.arange(s + 4, s + n - 2) for s, n in zip(starts, lens)])
    assert np.array_equal(pos, expected) and int(valid.max()) == 3
    plain = HeadData(cache, 3, val_fraction=0.2, seed=0, device=torch.device("cpu"))
    more = HeadData(cache, 3, val_fraction=0.2, seed=0, device=torch.device("cpu"), prompt_positions=True)
    assert torch.equal(more.val_pos, plain.val_pos)  # held out: responses only, either way
    held = set(more.val_start.tolist())
    prompt_rows = {int(s) + 4 + i for s, p in zip(starts, plens) if int(s) not in held for i in range(p - 5)}
    assert set(more.train_pos.tolist()) == set(plain.train_pos.tolist()) | prompt_rows
    b = more.batch(more.train_pos[:8], more.train_valid[:8])  # prompt rows: the prompt's own tokens
    assert torch.equal(b["tokens"][:, 0], more.tokens[more.train_pos[:8] + 1])
    synthetic_head_cache(tmp_path / "old", VOCAB, D, lens)  # only the last prompt token cached
    with pytest.raises(ValueError, match="no prompt hidden states"):
        HeadData(HiddenCache(tmp_path / "old"), 3, val_fraction=0.2, seed=0, device=torch.device("cpu"),
                 prompt_positions=True)


@pytest.mark.slow
def test_measured_acceptance_table(tmp_path: Path) -> None:
    """The table counts, per depth / rank / confidence bin, head k's held-out candidates and how
    many were the target's token; it is saved beside the checkpoint, loaded by the drafter (its
    builder's calibration) unless ``table=off``, and a table for other heads is refused."""
    from dyntree.common.drafters.hydra import make_hydra_drafter

    from dyntree.training.data import HiddenCache

    embed, lm_head = _target()
    # tokens mostly follow a fixed successor map, and the target's state at each token predicts its
    # successor: a learnable task whose candidates are right at rank 0 far more often than lower
    rng = np.random.default_rng(0)
    succ = rng.permutation(60)
    lens = [30] * 24
    tokens = np.empty(sum(lens), dtype=np.int64)
    tokens[0] = 0
    for i in range(1, tokens.size):
        tokens[i] = succ[tokens[i - 1]] if rng.random() < 0.8 else rng.integers(0, 60)
    rows = lm_head[torch.from_numpy(succ[tokens])]
    (tmp_path / "cache").mkdir()
    np.save(tmp_path / "cache" / "tokens.npy", tokens.astype(np.int32))
    np.save(tmp_path / "cache" / "hidden.npy", (3 * rows / rows.norm(dim=-1, keepdim=True) * 4).numpy().astype(np.float16))
    np.save(tmp_path / "cache" / "offsets.npy", np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
    (tmp_path / "cache" / "meta.json").write_text(json.dumps({"hidden_size": D, "sequences": 24, "tokens": sum(lens)}))
    cache = HiddenCache(tmp_path / "cache")
    cfg = HydraConfig(num_heads=3, num_layers=1, hidden_size=D, target=IDENT, reduced_vocab=64)
    heads = HydraHeads(cfg, embed, lm_head, reduced_token_map(cache.token_counts(VOCAB), 64))
    data = HeadData(cache, 3, val_fraction=0.2, seed=0, device=torch.device("cpu"))
    train(heads, data, TrainConfig(steps=150, batch_size=64, lr=1e-2, warmup=5), tmp_path / "run")
    table = measure_acceptance(heads, data, ranks=4)
    assert table.acceptance.shape == (3, 4, len(CONFIDENCE_EDGES) + 1) and table.edges == CONFIDENCE_EDGES
    # every held-out position with a target for head k is counted once per rank
    per_depth = data.batch(data.val_pos, data.val_valid)["mask"].sum(0)
    assert table.counts.sum((1, 2)).tolist() == (per_depth * 4).tolist()
    # the rank-0 acceptance is the held-out top-1 agreement (up to the shrinkage's pull)
    top1 = evaluate(heads, data)["top1"]
    rate = (table.acceptance * table.counts).sum(-1) / table.counts.sum(-1)  # [depth, rank]
    assert all(abs(a - b) < 0.05 for a, b in zip(rate[:, 0].tolist(), top1)), (rate, top1)
    assert bool((rate[:, 0] > 0.3).all()) and bool((rate[:, 0] > 3 * rate[:, 3]).all()), rate  # learned
    save_heads(heads, tmp_path / "ckpt")
    table.save(tmp_path / "ckpt" / "acceptance.json")
    back = load_acceptance(tmp_path / "ckpt")
    assert torch.allclose(back.acceptance, table.acceptance, atol=1e-5) and back.edges == CONFIDENCE_EDGES
    from dyntree.common.drafter import TargetInfo

    target = TargetInfo("tiny", D, embed, lm_head, "ab" * 32)
    assert make_hydra_drafter(str(tmp_path / "ckpt"), target=target).acceptance_table is not None
    assert make_hydra_drafter(f"{tmp_path / 'ckpt'},table=off", target=target).acceptance_table is None
    sp = Speculator(make_hydra_drafter(str(tmp_path / "ckpt"), target=target), SpecConfig(tree="dyntree"),
                    vocab_size=VOCAB)
    assert sp.builder is not None and sp.builder.calibrator.table is not None
    # the heads run in the target's dtype, except fp16 on a CPU (emulated there): fp32
    for dt, want in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32), (torch.float32, torch.float32)):
        t = TargetInfo("tiny", D, embed.to(dt), lm_head.to(dt), "ab" * 32)
        heads = make_hydra_drafter(str(tmp_path / "ckpt"), target=t).heads
        # fp32 heads on a CPU run their output rows as an int8 GEMM by default (where torch has FBGEMM);
        # bf16 heads only where the engine offers a weight-only kernel (none here)
        assert heads.out_weight.dtype == want and heads.int8 == (want == torch.float32 and int8_available())
    assert not make_hydra_drafter(f"{tmp_path / 'ckpt'},int8=off", target=target).heads.int8
    with pytest.raises(ValueError, match="int8=on needs heads on a CPU.*the engine offers no weight-only kernel"):
        make_hydra_drafter(f"{tmp_path / 'ckpt'},int8=on", target=TargetInfo("tiny", D, embed.bfloat16(),
                                                                             lm_head.bfloat16(), "ab" * 32))
    from dyntree.kernels.cpu_weight_only import CpuWeightOnly, cpu_kernels_available

    if cpu_kernels_available():  # with the kernel, bf16 heads take int8 weights by default
        t = TargetInfo("tiny", D, embed.bfloat16(), lm_head.bfloat16(), "ab" * 32, weight_kernel=CpuWeightOnly())
        assert make_hydra_drafter(str(tmp_path / "ckpt"), target=t).heads.int8
        assert not make_hydra_drafter(f"{tmp_path / 'ckpt'},int8=off", target=t).heads.int8
    cfg2 = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**cfg2, "num_heads": 2}))
    with pytest.raises(HydraMismatchError, match="3 depths, the heads 2"):
        load_acceptance(tmp_path / "ckpt")


def _perturbed_heads(d: int = 64, vocab: int = 300) -> HydraHeads:
    """Small Hydra++ heads with every weight moved off the identity start (every layer matters)."""
    torch.manual_seed(0)
    embed, lm_head = torch.randn(vocab, d), torch.randn(vocab, d) / d**0.5
    cfg = HydraConfig(num_heads=3, num_layers=2, hidden_size=d, target=TargetIdentity("tiny", d, vocab, "ab" * 32),
                      prefix_attention=True, prefix_heads=4)
    heads = HydraHeads(cfg, embed, lm_head).eval()
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return heads


@pytest.mark.skipif(not int8_available(), reason="torch without FBGEMM")
def test_int8_heads_track_fp32_heads() -> None:
    """Only the output rows run in int8: the prefix layer's states are the fp32 ones exactly, and
    every head's logits stay within a few % of the fp32 logits' range with the same top choice on
    nearly every row."""
    d, vocab = 64, 300
    heads = _perturbed_heads(d, vocab)
    hidden, path = torch.randn(1, 12, d), torch.randint(vocab, (12, 3))
    pos = torch.arange(12)[None]
    with torch.inference_mode():
        ref_h = heads.prefix_forward(hidden, pos)[0][0]
        ref = [heads.head_logits(k, ref_h, path[:, :k]) for k in (1, 2, 3)]
        assert not heads.int8
        heads.use_int8()
        got_h = heads.prefix_forward(hidden, pos)[0][0]
        got = [heads.head_logits(k, got_h, path[:, :k]) for k in (1, 2, 3)]
    assert heads.int8 and torch.equal(got_h, ref_h)
    for r, g in zip(ref, got):
        assert not torch.equal(g, r)  # the int8 product is in use
        assert (g - r).abs().max() < 0.05 * (r.max() - r.min()), (g - r).abs().max()
        assert (g.argmax(-1) == r.argmax(-1)).float().mean() >= 0.9


@pytest.mark.skipif(not int8_available(), reason="torch without FBGEMM")
def test_weight_only_int8_layers_track_fp32_heads() -> None:
    """With a weight-only kernel the heads' and the prefix layer's linears get int8 copies too:
    few-row calls (drafting) stay close to fp32, calls of many rows (the prefix layer catching up
    on a prompt) take the fp32 weights, exactly."""
    from dyntree.common.quant import QuantLinear
    from dyntree.kernels.cpu_weight_only import CpuWeightOnly, cpu_kernels_available

    if not cpu_kernels_available():
        pytest.skip("torch without the CPU weight-only ops")
    d, vocab = 64, 300
    heads = _perturbed_heads(d, vocab)
    hidden, path, pos = torch.randn(1, 12, d), torch.randint(vocab, (12, 3)), torch.arange(12)[None]
    long_hidden, long_pos = torch.randn(2, 20, d), torch.arange(20).expand(2, 20)  # 40 rows
    with torch.inference_mode():
        ref_h = heads.prefix_forward(hidden, pos)[0][0]
        ref = [heads.head_logits(k, ref_h, path[:, :k]) for k in (1, 2, 3)]
        ref_long = heads.prefix_forward(long_hidden, long_pos)[0]
        linears = sum(isinstance(m, nn.Linear) for m in heads.modules())
        heads.use_int8(CpuWeightOnly())
        # every linear, and the output rows (one int8 route: FBGEMM's kernel behind a QuantLinear)
        assert sum(isinstance(m, QuantLinear) for m in heads.modules()) == linears + 1
        got_h = heads.prefix_forward(hidden, pos)[0][0]  # 12 rows: the int8 copies
        got = [heads.head_logits(k, got_h, path[:, :k]) for k in (1, 2, 3)]
        assert torch.equal(heads.prefix_forward(long_hidden, long_pos)[0], ref_long)
    assert not torch.equal(got_h, ref_h) and (got_h - ref_h).abs().max() < 0.05 * ref_h.abs().max()
    for r, g in zip(ref, got):
        assert (g - r).abs().max() < 0.05 * (r.max() - r.min()), (g - r).abs().max()
        assert (g.argmax(-1) == r.argmax(-1)).float().mean() >= 0.9


def test_weight_only_int8_bf16_heads_track_bf16_heads() -> None:
    """bf16 heads (a CPU with native bf16) take int8 output rows (FBGEMM's int8 GEMM where torch
    has it, else the weight-only kernel): few-row calls stay close to the bf16 logits, a call of
    more rows than the cap takes the bf16 rows exactly; without a kernel they cannot go int8."""
    from dyntree.common.hydra import INT8_MAX_ROWS
    from dyntree.kernels.cpu_weight_only import CpuWeightOnly, FbgemmInt8, cpu_kernels_available, int8_available

    if not cpu_kernels_available():
        pytest.skip("torch without the CPU weight-only ops")
    d, vocab = 64, 300
    heads = _perturbed_heads(d, vocab).to(torch.bfloat16)
    hidden, path = torch.randn(12, d, dtype=torch.bfloat16), torch.randint(vocab, (12, 2))
    many = torch.randn(INT8_MAX_ROWS + 4, d, dtype=torch.bfloat16)
    with torch.inference_mode():
        ref = [heads.head_logits(1, hidden[:n], path[:n, :1]).float() for n in (1, 4, 12)]
        assert not heads.int8
        z_ref = torch.nn.functional.linear(many, heads.out_weight)
        with pytest.raises(ValueError, match="need a weight-only kernel"):
            heads.use_int8()
        heads.use_int8(CpuWeightOnly())
        got = [heads.head_logits(1, hidden[:n], path[:n, :1]).float() for n in (1, 4, 12)]
        assert torch.equal(heads._out_int8(many), z_ref)  # more rows than the cap: the bf16 rows
        few, z_few = many[:4], z_ref[:4]
        assert not torch.equal(heads._out_int8(few), z_few)  # the output rows themselves run in int8
        assert (heads._out_int8(few) - z_few).abs().max() < 0.05 * (z_few.max() - z_few.min())
        # one int8 route: the rows are a QuantLinear whose kernel is FBGEMM where torch has it
        assert isinstance(heads._out_int8.small.kernel, FbgemmInt8) == int8_available()
        if int8_available():  # the rows' product is FBGEMM's, of the bf16 rows, in fp32
            assert heads._out_int8(few).dtype == torch.float32
    assert heads.int8
    for r, g in zip(ref, got):
        assert not torch.equal(g, r)  # the int8 product is in use
        assert (g - r).abs().max() < 0.05 * (r.max() - r.min()), (g - r).abs().max()
        assert (g.argmax(-1) == r.argmax(-1)).float().mean() >= 0.75


def test_expand_scores_frontiers_with_the_matching_head() -> None:
    """The tree builder's interface: head d scores nodes at depth d-1 (its top-k of the softmax,
    reduced ids mapped back), nodes past the last head and requests without a hidden state get no
    children, and ids the target's vocabulary lacks are refused."""
    from dyntree.common.builder import PartialTree
    from dyntree.common.calibration import entropy

    heads = _counting_heads(k=2)
    drafter = HydraDrafter(heads)
    h = torch.randn(D)
    drafter.observe_hidden(0, h[None])
    part = PartialTree(tokens=[7, 4, 10], parents=[-1, 0, 1], depths=[0, 1, 2])
    reqs = [DraftRequest(0, [5, 7], 8, 4), DraftRequest(1, [7], 8, 4)]  # request 1: no hidden state
    heads.calls = []
    k = 5
    cands = drafter.expand(reqs, [[0, 1, 2], [0]], [part, PartialTree([7], [-1], [0])], k, None)
    assert cands.ids.shape == cands.probs.shape == (4, k) and cands.entropy.shape == (4,)
    assert sorted(heads.calls) == [(1, 1), (2, 1)]  # one forward per depth
    for row, path, depth in [(0, [7], 1), (1, [7, 4], 2)]:
        want = torch.softmax(heads.head_logits(depth, h[None], torch.tensor([path])), -1)[0]
        top = want.topk(k)
        assert cands.ids[row].tolist() == heads.token_map[top.indices].tolist()
        assert torch.allclose(cands.probs[row], top.values)
        assert torch.allclose(cands.entropy[row], entropy(want[None])[0])
    assert bool((cands.ids[:2] % 2 == 0).all())  # odd ids are outside the reduced vocabulary
    assert not cands.probs[2].any() and not cands.probs[3].any()  # past the last head; no hidden
    # the target's vocabulary bounds candidate ids: the builder refuses ids past it
    small = int(cands.ids[0, 0])  # the root's best candidate is always drafted
    sp = Speculator(drafter, SpecConfig(max_nodes=4, max_depth=2), vocab_size=small)
    with pytest.raises(ValueError, match=rf"must lie in \[0, {small}\)"):
        sp.propose([SpecRequest(0, [5, 7])])


@pytest.mark.parametrize("idle", [12, 30, 41])
def test_a_request_idle_past_the_context_restarts_on_its_last_context_positions(idle: int) -> None:
    """Pushed one position at a time without drafting past ``context`` positions, a request's
    prefix layer starts over on the last ``context`` of them: it catches up exactly those and
    drafts what a drafter handed only them (at their absolute positions) drafts."""
    heads = _perturbed_heads()
    rows = torch.randn(idle, heads.config.hidden_size)
    tokens = list(range(1, idle + 2))  # the root after ``idle`` committed positions
    idle_drafter, fresh = HydraDrafter(heads, context=8), HydraDrafter(heads, context=8)
    for i in range(idle):
        idle_drafter.observe_hidden(0, rows[i : i + 1])
    fresh.observe_hidden(0, rows[-8:], start=idle - 8)
    trees = []
    for drafter in (idle_drafter, fresh):
        sp = Speculator(drafter, SpecConfig(max_nodes=6, max_depth=3), vocab_size=heads.config.target.vocab_size)
        assert drafter.catch_up([DraftRequest(0, tokens, 6, 3)]) == [8]
        trees.append(sp.propose([SpecRequest(0, tokens)]).trees[0])
    assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(trees[0].parents, trees[1].parents)
    assert torch.allclose(trees[0].draft_probs, trees[1].draft_probs)


@pytest.mark.parametrize("context", [8, 0])
def test_pushed_rows_are_written_in_place_in_storage_kept_per_request(context: int) -> None:
    """Decoding steps' pushes write into storage the request keeps (with a bounded context, one
    buffer for the request's life: nothing a step allocates outlives it; unbounded, storage that
    at least doubles when it grows), and the pending rows are always the newest ones pushed since
    the layer last ran, whatever the mix of push sizes and of the two push calls (past
    ``2 * context`` pending positions, the newest ``context``)."""
    heads = _perturbed_heads()
    drafter = HydraDrafter(heads, context=context)
    pushed: list[torch.Tensor] = []
    storages: list[torch.Tensor] = []  # each storage the request's rows were written to, in order
    expected = 0  # pending positions: all of them, or past 2 * context the newest context
    for step, n in enumerate([1] * 5 + [3] + [1] * 20 + [11] + [1] * 9 + [2, 1, 1]):
        rows = torch.randn(n, heads.config.hidden_size)
        if n == 1 and step % 2:  # a plain decoding step's batch call
            drafter.observe_hidden_rows(["a"], rows, [None])
        else:
            drafter.observe_hidden("a", rows)
        pushed.append(rows.to(drafter.dtype, copy=True))
        rows.zero_()  # the engine reuses its output buffer: the drafter must hold no view of it
        s = drafter._state["a"]
        if not storages or s.rows is not storages[-1]:
            storages.append(s.rows)
        assert torch.equal(s.pending(), torch.cat(pushed)[-s.pending_rows :])
        expected += n
        if context and expected > 2 * context:
            expected = context
        assert s.pending_rows == expected
    sizes = [x.shape[0] for x in storages]
    if context:
        assert sizes == [2 * context]
    else:
        assert len(sizes) > 1 and all(b >= 2 * a for a, b in zip(sizes, sizes[1:]))


def test_one_push_past_twice_the_context_restarts_a_layer_that_has_run() -> None:
    """A request whose prefix layer has run, then pushed more than ``2 * context`` positions at
    once, starts its layer over on the last ``context`` of them, as a fresh drafter handed only
    those (at their absolute positions) does."""
    heads = _perturbed_heads()
    rows = torch.randn(30, heads.config.hidden_size)
    drafter, fresh = HydraDrafter(heads, context=8), HydraDrafter(heads, context=8)
    vocab = heads.config.target.vocab_size
    drafter.observe_hidden(0, rows[:5])
    Speculator(drafter, SpecConfig(max_nodes=6, max_depth=3), vocab_size=vocab).propose([SpecRequest(0, list(range(1, 7)))])
    drafter.observe_hidden(0, rows[5:])  # 25 positions in one push
    fresh.observe_hidden(0, rows[-8:], start=22)
    tokens = list(range(1, 32))  # the root after 30 committed positions
    trees = []
    for d in (drafter, fresh):
        assert d.catch_up([DraftRequest(0, tokens, 6, 3)]) == [8]
        trees.append(Speculator(d, SpecConfig(max_nodes=6, max_depth=3), vocab_size=vocab).propose([SpecRequest(0, tokens)]).trees[0])
    assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(trees[0].parents, trees[1].parents)
    assert torch.allclose(trees[0].draft_probs, trees[1].draft_probs)
