"""Hydra++ prefix attention: the layer and its KV cache, checkpoints, the drafter's per-request
state, the hidden-state rows the engine pushes (``observe_hidden``), and training on windows
(fast, tiny models)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Hashable, Sequence

import pytest
import torch

from spec_support import OracleDrafter, synthetic_head_cache, tiny_llama
from dyntree.common.config import SamplingParams, SpecConfig
from dyntree.common.controller import Plan
from dyntree.common.drafter import DraftRequest
from dyntree.common.drafters import make_drafter
from dyntree.common.drafters.hydra import HydraDrafter
from dyntree.common.hydra import HydraConfig, HydraHeads, HydraMismatchError, PrefixKV, TargetIdentity
from dyntree.common.hydra_checkpoint import load_acceptance, load_heads, save_heads
from dyntree.common.speculator import Speculator, SpecRequest
from dyntree.common.tree import DraftTree
from dyntree.standalone.engine import SpecEngine
from dyntree.standalone.target import make_hf_drafter
from dyntree.training.data import HiddenCache
from dyntree.training.trainer import (HeadData, TrainConfig, _losses, checkpoint_token_map, evaluate, reduced_token_map,
                                      train, warm_start)

D, VOCAB = 16, 97
IDENT = TargetIdentity("tiny", D, VOCAB, "ab" * 32)


def _target() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(VOCAB, D, generator=g), torch.randn(VOCAB, D, generator=g)


def _prefix_heads(k: int = 3, reduced: int = 0, seed: int = 0, randomize: bool = True) -> HydraHeads:
    cfg = HydraConfig(num_heads=k, num_layers=1, hidden_size=D, target=IDENT, reduced_vocab=reduced,
                      prefix_attention=True, prefix_heads=2)
    heads = HydraHeads(cfg, *_target(), torch.arange(0, 2 * reduced, 2) if reduced else None)
    if randomize:  # leave the identity init: make the prefix layer matter
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in heads.parameters():
                p.normal_(0.0, 0.3)
    return heads


def _seq(b: int, t: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, D, generator=g), torch.arange(t).expand(b, t)


def test_prefix_shapes_and_identity_init() -> None:
    x, pos = _seq(2, 7)
    out, kv = _prefix_heads().prefix_forward(x, pos)
    assert out.shape == (2, 7, D)
    assert kv.keys.shape == kv.values.shape == (2, 2, 7, D // 2) and bool(kv.slots().all())
    untrained, _ = _prefix_heads(randomize=False).prefix_forward(x, pos)
    assert torch.equal(untrained, x)  # zero output projections: h_t passes through unchanged
    with pytest.raises(HydraMismatchError, match="hidden_size=16"):
        _prefix_heads().prefix_forward(torch.randn(2, 7, D + 1), pos)
    plain = HydraHeads(HydraConfig(num_heads=1, num_layers=1, hidden_size=D, target=IDENT), *_target())
    assert plain.prefix is None
    with pytest.raises(HydraMismatchError, match="prefix_attention=True"):
        plain.prefix_forward(x, pos)


def test_single_row_cache_grows_in_place_and_branches_safely() -> None:
    """A lone sequence's cache grows in its storage (no copy of the cache per step); extending an
    older cache again (a branch) copies it, so neither branch sees the other's slots."""
    heads = _prefix_heads()
    x, pos = _seq(1, 10)
    full, _ = heads.prefix_forward(x, pos)
    _, kv = heads.prefix_forward(x[:, :6], pos[:, :6])
    out_a, kv_a = heads.prefix_forward(x[:, 6:8], pos[:, 6:8], kv)
    assert kv_a.store is kv.store and kv_a.keys.data_ptr() == kv.keys.data_ptr()  # grew in place
    y, _ = _seq(1, 10, seed=7)
    out_b, kv_b = heads.prefix_forward(y[:, 6:8], pos[:, 6:8], kv)  # a branch from the older cache
    assert kv_b.store is not kv.store
    out_a2, _ = heads.prefix_forward(x[:, 8:10], pos[:, 8:10], kv_a)
    assert torch.allclose(torch.cat([out_a, out_a2], 1), full[:, 6:], atol=1e-5)  # branch a untouched by b
    want_b, _ = heads.prefix_forward(torch.cat([x[:, :6], y[:, 6:8]], 1), pos[:, :8])
    assert torch.allclose(out_b, want_b[:, 6:], atol=1e-5)
    assert kv.length == 6 and kv_a.length == 8 and kv_b.length == 8


def test_incremental_chunks_equal_one_full_pass() -> None:
    """The KV cache is exact: chunked (also batched with padding, rows of different lengths)
    equals one causal pass over the whole sequence."""
    heads = _prefix_heads()
    x, pos = _seq(3, 12)
    full, full_kv = heads.prefix_forward(x, pos)
    outs, kv = [], None
    for a, b in [(0, 3), (3, 4), (4, 9), (9, 12)]:
        out, kv = heads.prefix_forward(x[:, a:b], pos[:, a:b], kv)
        outs.append(out)
    assert torch.allclose(torch.cat(outs, 1), full, atol=1e-5)
    assert torch.allclose(kv.keys, full_kv.keys, atol=1e-5)
    # per-row caches of different lengths, advanced together with padding (the drafter's case)
    cut = [2, 5, 0]
    rows = []
    for r, c in enumerate(cut):
        _, k = heads.prefix_forward(x[r : r + 1, :c], pos[r : r + 1, :c])
        rows.append(k)
    n = [4, 7, 3]  # new positions per row
    width = max(n)
    new = torch.zeros(3, width, D)
    valid = torch.zeros(3, width, dtype=torch.bool)
    for r, (c, m) in enumerate(zip(cut, n)):
        new[r, :m] = x[r, c : c + m]
        valid[r, :m] = True
    positions = torch.tensor(cut)[:, None] + torch.arange(width)
    out, kv = heads.prefix_forward(new, positions, PrefixKV.stack(rows), valid)
    for r, (c, m) in enumerate(zip(cut, n)):
        assert torch.allclose(out[r, :m], full[r, c : c + m], atol=1e-5)
        row = kv.row(r)
        assert row.length == c + m
        assert torch.allclose(row.keys, full_kv.keys[r : r + 1, :, : c + m], atol=1e-5)


def test_prefix_layer_is_causal_and_reads_the_prefix() -> None:
    heads = _prefix_heads()
    x, pos = _seq(1, 8)
    y = x.clone()
    y[0, 3] += 1.0
    a, b = heads.prefix_forward(x, pos)[0], heads.prefix_forward(y, pos)[0]
    assert torch.equal(a[0, :3], b[0, :3])  # earlier positions never see later ones
    assert (a[0, 4:] - b[0, 4:]).abs().amax(-1).min() > 1e-4  # every later position reads position 3


def test_sequential_dependency_with_prefix_attention() -> None:
    """Head 2 still depends on head 1's token when the heads read the prefix layer's output."""
    heads = _prefix_heads()
    x, pos = _seq(4, 6)
    h = heads.prefix_forward(x, pos)[0][:, -1]
    a = torch.randint(0, VOCAB, (4, 3))
    b = a.clone()
    b[:, 1] = (a[:, 1] + 1) % VOCAB
    la, lb = heads(h, a), heads(h, b)
    assert torch.equal(la[:, 0], lb[:, 0])
    assert (la[:, 1] - lb[:, 1]).abs().max().item() > 1e-3


def test_config_validation_names_the_field() -> None:
    with pytest.raises(HydraMismatchError, match="prefix_heads=3 must be a positive divisor"):
        HydraConfig(num_heads=1, num_layers=1, hidden_size=D, target=IDENT, prefix_attention=True, prefix_heads=3)
    with pytest.raises(HydraMismatchError, match="prefix_heads=16 gives an odd head size"):
        HydraConfig(num_heads=1, num_layers=1, hidden_size=D, target=IDENT, prefix_attention=True, prefix_heads=16)
    with pytest.raises(HydraMismatchError, match="prefix_heads=2 must be 0 when prefix_attention is False"):
        HydraConfig(num_heads=1, num_layers=1, hidden_size=D, target=IDENT, prefix_heads=2)


def test_save_load_round_trip_and_old_configs(tmp_path: Path) -> None:
    heads = _prefix_heads(reduced=20)
    save_heads(heads, tmp_path / "new", dtype=torch.float32)
    cfg = json.loads((tmp_path / "new" / "config.json").read_text())
    assert cfg["prefix_attention"] is True and cfg["prefix_heads"] == 2
    back = load_heads(tmp_path / "new", IDENT, *_target())
    x, pos = _seq(2, 5)
    assert torch.equal(back.prefix_forward(x, pos)[0], heads.prefix_forward(x, pos)[0])
    save_heads(heads, tmp_path / "fp16")  # fp16 weights run in bf16, positions far apart
    half = load_heads(tmp_path / "fp16", IDENT, *_target(), dtype=torch.bfloat16)
    far = pos * 997
    want = heads.prefix_forward(x, far)[0]
    assert (half.prefix_forward(x, far)[0].float() - want).abs().max() < 0.05 * want.abs().max()
    # a checkpoint written before prefix attention existed: no such fields, no such weights
    plain = HydraHeads(HydraConfig(num_heads=2, num_layers=1, hidden_size=D, target=IDENT), *_target())
    save_heads(plain, tmp_path / "old")
    old = json.loads((tmp_path / "old" / "config.json").read_text())
    del old["prefix_attention"], old["prefix_heads"]
    (tmp_path / "old" / "config.json").write_text(json.dumps(old))
    loaded = load_heads(tmp_path / "old", IDENT, *_target())
    assert loaded.config.prefix_attention is False and loaded.prefix is None
    # prefix weights without the flag (or the flag without the weights) are refused
    (tmp_path / "new" / "config.json").write_text(json.dumps({**cfg, "prefix_attention": False, "prefix_heads": 0}))
    with pytest.raises(HydraMismatchError, match="unexpected"):
        load_heads(tmp_path / "new", IDENT, *_target())


def _history(n: int, seed: int = 5) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed))


def _speculator(drafter: HydraDrafter, max_nodes: int = 6, max_depth: int = 3) -> Speculator:
    """The drafter's own (``beam``) trees through the public speculation API."""
    return Speculator(drafter, SpecConfig(max_nodes=max_nodes, max_depth=max_depth), vocab_size=VOCAB)


def test_drafter_feeds_the_heads_the_prefix_output_incrementally() -> None:
    """Over several pushes and steps the drafter's prefix cache equals one full pass over the whole
    history, for its own trees and for ``expand``, batched over requests of different lengths."""
    from dyntree.common.builder import PartialTree

    heads = _prefix_heads(k=2)
    drafter = HydraDrafter(heads, width=2, topk=2)
    assert drafter.needs_hidden and heads.prefix is not None
    sp = _speculator(drafter)
    hist = {0: _history(9, 5), 1: _history(6, 6)}
    full = {i: heads.prefix_forward(h[None], torch.arange(h.shape[0])[None])[0][0] for i, h in hist.items()}

    def push(i: int, done: int, upto: int) -> None:  # positions done..upto-1 are new
        sp.observe_hidden(i, hist[i][done:upto])

    def head1(i: int, upto: int) -> torch.Tensor:
        return torch.softmax(heads.head_logits(1, full[i][upto - 1][None], torch.tensor([[3]])), -1)[0]

    push(0, 0, 4)
    push(1, 0, 2)
    trees = sp.propose([SpecRequest(0, [3] * 5), SpecRequest(1, [3] * 3)]).trees
    for i, upto, tree in [(0, 4, trees[0]), (1, 2, trees[1])]:
        assert tree.tokens[tree.children(0)].tolist() == head1(i, upto).topk(2).indices.tolist()
    push(0, 4, 6)  # several pushes between steps: ingested together
    push(0, 6, 9)
    push(1, 2, 6)
    reqs = [DraftRequest(0, [3] * 10, 6, 3), DraftRequest(1, [3] * 7, 6, 3)]
    root = PartialTree([3], [-1], [0])
    for _ in range(2):  # one call per depth sees the same rows: ingested once
        c = drafter.expand(reqs, [[0], [0]], [root, root], VOCAB, None)
        for row, (i, upto) in enumerate([(0, 9), (1, 6)]):
            dense = torch.zeros(VOCAB).scatter(0, c.ids[row], c.probs[row])  # k = VOCAB: the whole row
            assert torch.allclose(dense, head1(i, upto), atol=1e-5)
    assert all(drafter._state[i].kv.length == hist[i].shape[0] for i in hist)
    sp.release(0)
    assert list(drafter._state) == [1]
    one_token = SpecRequest(7, [3])  # nothing cached yet: no input, no speculation
    assert sp.propose([one_token]).trees[0].size == 1


def test_prefix_layer_starts_from_the_last_context_positions() -> None:
    """A request's prefix layer starts on the last ``context`` committed positions only (then
    grows step by step, as one pass over the history from there); ``context=0`` reads them all."""
    heads = _prefix_heads(k=2)
    h = _history(14)

    def last_state(context: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        drafter = HydraDrafter(heads, width=2, topk=2, context=context)
        sp = _speculator(drafter)
        sp.observe_hidden(0, h[:12])
        sp.propose([SpecRequest(0, [3] * 13)])
        first = drafter._state[0].last
        sp.observe_hidden(0, h[12:])
        sp.propose([SpecRequest(0, [3] * 15)])
        return first, drafter._state[0].last, drafter._state[0].kv.length

    def one_pass(start: int, end: int) -> torch.Tensor:
        return heads.prefix_forward(h[None, start:end], torch.arange(start, end)[None])[0][0, -1]

    first, then, length = last_state(5)
    assert torch.allclose(first, one_pass(7, 12), atol=1e-5) and torch.allclose(then, one_pass(7, 14), atol=1e-5)
    assert length == 7 and not torch.allclose(first, one_pass(0, 12), atol=1e-3)
    first, then, length = last_state(0)
    assert torch.allclose(first, one_pass(0, 12), atol=1e-5) and torch.allclose(then, one_pass(0, 14), atol=1e-5)
    assert length == 14
    with pytest.raises(ValueError, match="context must be >= 0"):
        HydraDrafter(heads, context=-1)


def test_catching_up_is_timed_apart_and_an_idle_request_starts_over_on_its_context() -> None:
    """A request whose layer starts, or that has more positions pending than one step commits
    (it idled), catches up in a timed batch of its own (``catch_up`` counts its positions beforehand,
    ``pop_catch_up`` reports time and positions), beside the batch of requests that drafted last
    step (not timed); one that idled past ``context`` positions starts its layer over on the last
    ``context`` of them, as a new request would."""
    heads = _prefix_heads(k=2)
    h = _history(30)
    drafter = HydraDrafter(heads, width=2, topk=2, context=5)
    sp = _speculator(drafter)
    batches: list[int] = []
    forward = drafter._forward_pending
    drafter._forward_pending = lambda todo: (todo and batches.append(len(todo))) or forward(todo)  # type: ignore[method-assign]
    popped: list[tuple[float, int]] = []  # what the speculator takes after each propose
    pop = drafter.pop_catch_up
    drafter.pop_catch_up = lambda: popped.append(pop()) or popped[-1]  # type: ignore[method-assign]

    def pending(*lengths: int) -> list[int]:
        return drafter.catch_up([DraftRequest(i, [3] * (n + 1), 6, 3) for i, n in enumerate(lengths)])

    def one_pass(start: int, end: int) -> torch.Tensor:
        return heads.prefix_forward(h[None, start:end], torch.arange(start, end)[None])[0][0, -1]

    sp.observe_hidden(0, h[:4])
    sp.observe_hidden(1, h[:3])
    assert pending(4, 3) == [4, 3]
    sp.propose([SpecRequest(0, [3] * 5), SpecRequest(1, [3] * 4)])
    assert popped[-1][0] > 0 and popped[-1][1] == 7 and pop() == (0.0, 0) and batches == [2]
    sp.observe_hidden(0, h[4:6])  # one step's accepted positions: no catch-up
    for i in range(3, 7):  # request 1 idled 4 steps: more positions than one step commits (3)
        sp.observe_hidden(1, h[i : i + 1])
    assert pending(6, 7) == [0, 4]
    batches.clear()
    sp.propose([SpecRequest(0, [3] * 7), SpecRequest(1, [3] * 8)])
    assert batches == [1, 1] and popped[-1][0] > 0 and popped[-1][1] == 4
    assert torch.allclose(drafter._state[0].last, one_pass(0, 6), atol=1e-5)
    assert torch.allclose(drafter._state[1].last, one_pass(0, 7), atol=1e-5)
    sp.observe_hidden(0, h[6:7])  # one idle step: its position rides with the step's batch
    sp.observe_hidden(0, h[7:8])
    assert pending(8) == [0]
    batches.clear()
    sp.propose([SpecRequest(0, [3] * 9)])
    assert batches == [1] and popped[-1] == (0.0, 0)
    for i in range(8, 20):  # idle for 12 steps: more than the context of 5
        sp.observe_hidden(0, h[i : i + 1])
    assert drafter._state[0].kv is None and pending(20) == [5]
    sp.propose([SpecRequest(0, [3] * 21)])
    assert popped[-1][0] > 0 and popped[-1][1] == 5
    assert torch.allclose(drafter._state[0].last, one_pass(15, 20), atol=1e-5)
    assert drafter._state[0].kv.length == 5


@pytest.mark.parametrize("prefix", [True, False])
def test_a_plain_steps_rows_pushed_at_once_equal_pushes_one_by_one(prefix: bool) -> None:
    """``observe_hidden_rows`` (one call for a plain decoding step's batch, one row per request)
    leaves each request where one ``observe_hidden`` per request does: the same drafts and the
    same heads' input, a position skip (``start``) included; a row count that is not the
    requests' is refused."""
    heads = _prefix_heads()
    if not prefix:
        heads = HydraHeads(replace(heads.config, prefix_attention=False, prefix_heads=0), *_target())
    h = [_history(12, seed=s) for s in (5, 6)]
    one, rows = HydraDrafter(heads, width=2, topk=2, context=5), HydraDrafter(heads, width=2, topk=2, context=5)
    for d in (one, rows):
        d.observe_hidden(0, h[0][:3])
        d.observe_hidden(1, h[1][:2])
    for step in range(8):  # request 1 skips a position at step 4 (a prefix-cache hit's start)
        starts = [3 + step, 2 + step + (step >= 4)]
        step_rows = torch.stack([h[0][starts[0]], h[1][starts[1]]])
        for b in (0, 1):
            one.observe_hidden(b, step_rows[b : b + 1], starts[b])
        rows.observe_hidden_rows([0, 1], step_rows, starts)
        step_rows.fill_(float("nan"))  # the engine reuses its output buffer: both kept copies
    requests = [SpecRequest(0, [3] * 12), SpecRequest(1, [3] * 12)]
    got = [_speculator(d).propose(requests).trees for d in (one, rows)]
    assert [t.tokens.tolist() for t in got[0]] == [t.tokens.tolist() for t in got[1]]
    for b in (0, 1):
        assert torch.equal(one._state[b].last, rows._state[b].last) and one._state[b].pushed == rows._state[b].pushed
    with pytest.raises(ValueError, match=r"2 requests but 1 rows"):
        rows.observe_hidden_rows([0, 1], h[0][:1], [None, None])
    with pytest.raises(ValueError, match=r"a step of 2 requests: hidden states of shape \(2, 17\)"):
        rows.observe_hidden_rows([0, 1], torch.randn(2, D + 1), [None, None])


@pytest.mark.parametrize("prefix", [True, False])
def test_drafter_refuses_missing_rows(prefix: bool) -> None:
    heads = _prefix_heads()
    if not prefix:  # the plain heads check the rows the same way
        heads = HydraHeads(replace(heads.config, prefix_attention=False, prefix_heads=0), *_target())
    drafter = HydraDrafter(heads)
    sp = _speculator(drafter, 4, 2)
    h = _history(5)
    six = SpecRequest(0, [1] * 6)  # kv_len 5: positions 0..4 are committed
    with pytest.raises(ValueError, match=r"pushed hidden states for 0 positions, but 5 tokens are committed"):
        sp.propose([six])
    sp.observe_hidden(0, h[2:])  # rows 0..1 missing
    with pytest.raises(ValueError, match=r"pushed hidden states for 3 positions, but 5 tokens are committed"):
        sp.propose([six])
    sp.release(0)
    with pytest.raises(ValueError, match=r"shape \(5, 17\); expected \[n, 16\]"):
        sp.observe_hidden(0, torch.randn(5, D + 1))
    with pytest.raises(ValueError, match=r"shape \(16,\); expected \[n, 16\]"):
        sp.observe_hidden(0, h[-1])  # one row needs its row dimension
    sp.observe_hidden(0, h[:3])
    sp.propose([SpecRequest(0, [1] * 4)])
    sp.observe_hidden(0, h[2:])  # row 2 repeated: 6 rows for 5 positions
    with pytest.raises(ValueError, match=r"pushed hidden states for 6 positions, but 5 tokens are committed"):
        sp.propose([six])
    sp.release(0)
    sp.observe_hidden(0, h[:3])
    sp.observe_hidden(0, h)  # id reused without release: positions 0..2 twice
    with pytest.raises(ValueError, match=r"pushed hidden states for 8 positions, but 5 tokens are committed"):
        sp.propose([six])
    sp.release(0)
    sp.observe_hidden(0, h)
    assert sp.propose([six]).trees[0].size > 1
    # an engine that skipped positions (a prefix-cache hit) says where its rows start: plain heads
    # need only the newest state; a prefix layer starts over there: its output is that of one pass
    # over the rows pushed since (no stale rows from before)
    sp.release(0)
    sp.observe_hidden(0, h[3:], start=3)
    assert sp.propose([six]).trees[0].size > 1
    if prefix:
        want = heads.prefix_forward(h[None, 3:], torch.arange(3, 5)[None])[0][0, -1]
        assert torch.allclose(drafter._state[0].last, want, atol=1e-5)
        # a recomputation from an earlier position (preemption) starts the layer over there
        sp.observe_hidden(0, h[1:], start=1)
        sp.propose([six])
        want = heads.prefix_forward(h[None, 1:], torch.arange(1, 5)[None])[0][0, -1]
        assert torch.allclose(drafter._state[0].last, want, atol=1e-5)


# -- the rows the engine pushes ---------------------------------------------------------------


class _Recorder(OracleDrafter):
    """The oracle drafter (wrong where ``refs`` were corrupted) that records the hidden states it
    is pushed and, at each ``propose``, how many committed positions they covered."""

    needs_hidden = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pushed: dict[Hashable, list[torch.Tensor]] = {}
        self.calls: dict[Hashable, list[tuple[int, int]]] = {}  # (kv_len, rows pushed so far)

    def observe_hidden(self, request_id: Hashable, states: torch.Tensor, start: int | None = None) -> None:
        self.pushed.setdefault(request_id, []).append(states.clone())

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        for r in requests:
            rows = sum(x.shape[0] for x in self.pushed.get(r.request_id, []))
            self.calls.setdefault(r.request_id, []).append((r.kv_len, rows))
        return super().propose(requests)


class _Alternating:
    """A stand-in controller: plain decoding (no drafter call) every other step."""

    def __init__(self) -> None:
        self.n = 0

    def plan(self, ids: Sequence[Hashable], kv: int | None = None, available: Sequence[bool] | None = None,
             catch_up: Sequence[int] | None = None, remaining: Sequence[int | None] | None = None,
             waiting: int | None = None, evidence: Sequence[int] | None = None) -> list[Plan]:
        self.n += 1
        return [Plan("none", 0, 0) if self.n % 2 == 0 else Plan("tree", 10, 5) for _ in ids]

    def observe_step(self, *_: Any) -> None: ...

    def observe_draft(self, *_: Any) -> None: ...

    def observe_outcome(self, *_: Any, **__: Any) -> None: ...

    def observe_plan_cost(self, *_: Any) -> None: ...

    def observe_cycle(self, *_: Any) -> None: ...

    def observe(self, *_: Any) -> None: ...

    def release(self, *_: Any) -> None: ...


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from dyntree.models import model_path

    return AutoTokenizer.from_pretrained(model_path("smollm2"))


@pytest.mark.parametrize("alternate", [False, True])
def test_engine_hidden_rows_equal_a_plain_forward(tok, alternate: bool) -> None:
    """At every drafter call the rows pushed so far cover exactly the committed positions
    ``0 .. kv_len - 1``, and all rows together equal the target's hidden states of a plain causal
    forward (steps that skip the drafter still push their rows)."""
    model = tiny_llama(4)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 9, 1)]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    plain = [o.token_ids for o in SpecEngine(model, tok, make_drafter("none")).generate(prompts, params)]
    refs = {i: [t if j % 4 != 2 else (t + 1) % 49152 for j, t in enumerate(p)] for i, p in enumerate(plain)}
    drafter = _Recorder(refs, {i: len(p) for i, p in enumerate(prompts)}, decoys=1)
    engine = SpecEngine(model, tok, drafter, SpecConfig(max_nodes=10, max_depth=5))
    if alternate:
        engine.speculator.controller = _Alternating()  # type: ignore[assignment]
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    assert any(1 < o.tau < 5 for o in outs)  # partial acceptance happened
    for i, p in enumerate(prompts):
        calls = drafter.calls[i]
        assert calls[0][0] == len(p)  # the first call: the prompt's rows (the prefill gave the first token)
        for kv_len, rows in calls:
            assert rows == kv_len  # every committed position once, in order, none ahead
        if alternate:
            assert len(calls) < outs[i].steps  # some steps skipped the drafter; their rows came anyway
        got = torch.cat(drafter.pushed[i])
        tokens = torch.tensor([p + plain[i]])
        assert calls[-1][0] < got.shape[0] <= tokens.shape[1]  # the last step's rows came too
        with torch.inference_mode():
            want = model.model(input_ids=tokens).last_hidden_state[0, : got.shape[0]]
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


# -- training on windows ----------------------------------------------------------------------


def _synthetic_cache(path: Path, seed: int = 0, prompt: int = 1):
    """Sequences of uneven lengths, so windows meet sequence starts; ``prompt`` tokens each."""
    lens = [30, 12, 25, 30, 7, 30, 18, 30] * 3
    return synthetic_head_cache(path, VOCAB, D, [n + prompt - 1 for n in lens], seed,
                                prompt_lens=[prompt] * len(lens) if prompt > 1 else None)


@pytest.mark.parametrize("prompt", [1, 6])
def test_windows_stay_inside_one_sequence(tmp_path: Path, prompt: int) -> None:
    """Training windows end at a training position and reach back up to ``window`` rows (into the
    prompt when the cache holds it), scoring heads only at response positions; held-out windows
    score every held-out position exactly once."""
    cache = _synthetic_cache(tmp_path / "cache", prompt=prompt)
    data = HeadData(cache, 3, val_fraction=0.25, seed=0, device=torch.device("cpu"))
    idx = torch.arange(0, data.train_pos.numel(), 7)
    b = data.train_windows(idx, 8)
    assert b["hidden"].shape == (idx.numel(), 8, D) and b["tokens"].shape == (idx.numel() * 8, 3)
    last = data.train_pos[idx]
    first = torch.maximum(data.train_start[idx], last - 7)
    rows = first[:, None] + torch.arange(8)
    mask = b["mask"].view(idx.numel(), 8, 3)
    scored = mask[..., 0]
    assert torch.equal(scored, (rows <= last[:, None]) & (rows >= data.train_rstart[idx, None]))
    assert torch.equal(b["hidden"][:, 0], data.hidden[first].float())
    assert bool((first < data.train_rstart[idx]).any()) == (prompt > 1)  # context from the prompt
    # head k has a target at row g iff g + k <= end - 2
    has_target = rows[..., None] + torch.arange(1, 4) <= data.train_end[idx, None, None] - 2
    assert torch.equal(mask, scored[..., None] & has_target)
    f, l, e, s = data.val_windows(8)
    assert bool((l - f < 8).all()) and bool((s >= f).all())
    covered = torch.cat([torch.arange(a, b + 1) for a, b in zip(s.tolist(), l.tolist())])
    assert torch.equal(covered.sort().values, data.val_pos.sort().values)
    assert bool((s > f).any())  # later steps see earlier rows as context


@pytest.mark.slow
def test_tiny_training_run_with_prefix_attention_reduces_loss(tmp_path: Path) -> None:
    cache = _synthetic_cache(tmp_path / "cache")
    token_map = reduced_token_map(cache.token_counts(VOCAB), 64)
    cfg = HydraConfig(num_heads=3, num_layers=1, hidden_size=D, target=IDENT, reduced_vocab=64,
                      prefix_attention=True, prefix_heads=2)
    heads = HydraHeads(cfg, *_target(), token_map)
    data = HeadData(cache, 3, val_fraction=0.2, seed=0, device=torch.device("cpu"))
    fixed = data.train_windows(torch.arange(0, data.train_pos.numel(), 5), 8)
    before, val_before = _losses(heads, fixed)[0], evaluate(heads, data, window=8)["loss"]
    tcfg = TrainConfig(steps=60, batch_size=128, lr=1e-2, warmup=5, save_every=30, window=8)
    assert tcfg.windows_per_batch == 16
    result = train(heads, data, tcfg, tmp_path / "run")
    after = _losses(heads, fixed)[0]
    assert bool((after < 0.7 * before).all()), (before, after)
    assert all(a < 0.7 * b for a, b in zip(result["val"]["loss"], val_before))
    assert heads.prefix is not None and heads.prefix.o_proj.weight.abs().sum() > 0  # the layer trained
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").open()]
    assert len(log[0]["loss"]) == 3 and len(log[0]["top1"]) == 3
    again = HydraHeads(cfg, *_target(), token_map)  # resuming a finished run: same weights
    train(again, data, tcfg, tmp_path / "run")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), heads.state_dict().values()))
    with pytest.raises(ValueError, match="another training config"):
        train(again, data, replace(tcfg, window=9), tmp_path / "run")


@pytest.mark.slow
def test_train_heads_cli_with_prefix_attention_end_to_end(tmp_path: Path, tok) -> None:
    """``train-heads --prefix-attention`` on a tiny target: data, training, checkpoint; the
    checkpoint loads as a drafter and greedy drafting with it reproduces plain decoding."""
    from dyntree.training.cli import main

    model = tiny_llama(6)
    model.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Tell me fact number {i} about rivers."}) + "\n" for i in range(8)))
    out = tmp_path / "heads"
    argv = ["train-heads", "--model", str(tmp_path / "target"), "--data", str(data), "--out", str(out),
            "--heads", "2", "--vocab-size", "512", "--steps", "20", "--batch-size", "32", "--window", "8",
            "--prompts", "8", "--max-new-tokens", "16", "--gen-batch-size", "8", "--threads", "1",
            "--work-dir", str(tmp_path / "work"), "--prefix-attention"]
    assert main(argv) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["prefix_attention"] is True and cfg["prefix_heads"] == 1 and cfg["training"]["window"] == 8
    assert cfg["training"]["generation"]["prompt_hidden"] is True and cfg["training"]["generation"]["dtype"] == "fp32"
    assert (out / "acceptance.json").is_file()  # the measured calibration ships with the heads
    drafter = make_hf_drafter(f"hydra:{out},width=3", model, tok)
    assert isinstance(drafter, HydraDrafter) and drafter.needs_hidden and drafter.heads.prefix is not None
    prompts = [tok.encode("The river"), tok.encode("Once upon a time there was")]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = SpecEngine(model, tok, make_drafter("none")).generate(prompts, params)
    spec = SpecEngine(model, tok, drafter, SpecConfig(max_nodes=6, max_depth=2)).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.draft_nodes for o in spec) > 0 and not drafter._state  # drafted; state released
    with pytest.raises(SystemExit, match="prefix_heads=3"):
        main([*argv[:-1], "--prefix-attention", "--prefix-heads", "3", "--out", str(tmp_path / "bad")])
    # fine-tuning from the checkpoint: same cached data, a new run
    tuned = [*argv, "--init-from", str(out), "--steps", "2", "--cache-dir", str(tmp_path / "work" / "cache"),
             "--work-dir", str(tmp_path / "work2"), "--out", str(tmp_path / "tuned")]
    assert main(tuned) == 0
    assert json.loads((tmp_path / "tuned" / "config.json").read_text())["training"]["init_from"] == str(out)
    # measuring the checkpoint's acceptance on every sequence of another cache, without training
    with pytest.raises(SystemExit, match="--measure-acceptance needs --init-from"):
        main([*argv, "--measure-acceptance"])
    measured = [*argv, "--init-from", str(out), "--measure-acceptance", "--cache-dir", str(tmp_path / "work" / "cache"),
                "--out", str(tmp_path / "measured")]
    assert main(measured) == 0
    assert {f.name for f in (tmp_path / "measured").iterdir()} == {f.name for f in out.iterdir()}
    for f in ("config.json", "model.safetensors"):
        assert (tmp_path / "measured" / f).read_bytes() == (out / f).read_bytes()  # the heads unchanged
    table = load_acceptance(tmp_path / "measured")
    per_depth = table.counts[:, 0].sum(-1)  # every position of all 8 sequences, not a held-out share
    assert "8 responses to prompts the heads never saw" in table.source
    assert int(per_depth[0]) > 3 * int(load_acceptance(out).counts[0, 0].sum())  # training held out 1 of 8
    # ... and going on with newly generated data, whose own frequency ranking would give another
    # reduced vocabulary: the checkpoint's is kept (so its output rows keep their meaning)
    more = tmp_path / "more.jsonl"
    more.write_text("".join(json.dumps({"prompt": f"Write {i} lines of code in Rust, please."}) + "\n" for i in range(8)))
    fresh = [*argv, "--init-from", str(out), "--steps", "2", "--train-dtype", "bf16", "--work-dir",
             str(tmp_path / "work8"), "--out", str(tmp_path / "fresh")]
    fresh[fresh.index("--data") + 1] = str(more)
    assert main(fresh) == 0
    new_counts = HiddenCache(tmp_path / "work8" / "cache").token_counts(model.config.vocab_size)
    assert not torch.equal(reduced_token_map(new_counts, 512), checkpoint_token_map(out))
    assert torch.equal(checkpoint_token_map(tmp_path / "fresh"), checkpoint_token_map(out))
    assert json.loads((tmp_path / "fresh" / "config.json").read_text())["training"]["train_dtype"] == "bf16"
    with pytest.raises(SystemExit, match="--init-from: .*not a Hydra checkpoint"):
        main([*argv, "--init-from", str(tmp_path / "nope"), "--out", str(tmp_path / "t3")])
    with pytest.raises(SystemExit, match="--init-from: .*num_layers is 1, this run's is 2"):  # before any data
        main([*argv, "--init-from", str(out), "--layers", "2", "--work-dir", str(tmp_path / "work3"),
              "--out", str(tmp_path / "t4")])
    assert not (tmp_path / "work3").exists()
    with pytest.raises(SystemExit, match="--train-fraction must be in"):  # before any data
        main([*argv, "--train-fraction", "0", "--work-dir", str(tmp_path / "work7"), "--out", str(tmp_path / "t7")])
    with pytest.raises(SystemExit, match="--loss must be soft, hard or topK"):  # before any data
        main([*argv, "--loss", "kl", "--work-dir", str(tmp_path / "work7"), "--out", str(tmp_path / "t7")])
    with pytest.raises(SystemExit, match="--gen-batches must be >= 1, got 0"):  # before any data
        main([*argv, "--gen-batches", "0", "--work-dir", str(tmp_path / "work7"), "--out", str(tmp_path / "t7")])
    assert not (tmp_path / "work7").exists()
    with pytest.raises(SystemExit, match="--prompt-positions does not combine with --prefix-attention"):
        main([*argv, "--prompt-positions", "--out", str(tmp_path / "t5")])
    # the plain heads' options on the same cache: wider layers, prompt positions too
    wide = [*argv[:-1], "--layer-width", "2", "--prompt-positions", "--loss", "top8", "--train-fraction", "0.5",
            "--steps", "2", "--cache-dir",
            str(tmp_path / "work" / "cache"), "--work-dir", str(tmp_path / "work6"), "--out", str(tmp_path / "wide")]
    assert main(wide) == 0
    cfg = json.loads((tmp_path / "wide" / "config.json").read_text())
    assert cfg["layer_width"] == 2 and cfg["training"]["prompt_positions"] is True and cfg["training"]["loss"] == "top8"
    assert cfg["training"]["train_fraction"] == 0.5
    wide_drafter = make_hf_drafter(f"hydra:{tmp_path / 'wide'},width=3", model, tok)
    spec = SpecEngine(model, tok, wide_drafter, SpecConfig(max_nodes=6, max_depth=2)).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_warm_start_adds_a_prefix_layer_to_trained_heads(tmp_path: Path) -> None:
    """``train-heads --init-from``: trained heads' weights load into a prefix-attention run (the new
    layer starts as the identity, so the heads predict exactly as before); another architecture or
    token map is refused, naming it."""
    token_map = torch.arange(0, 40, 2)
    plain_cfg = HydraConfig(num_heads=3, num_layers=1, hidden_size=D, target=IDENT, reduced_vocab=20)
    trained = HydraHeads(plain_cfg, *_target(), token_map)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in trained.parameters():
            p.normal_(0.0, 0.3)
    save_heads(trained, tmp_path / "plain", torch.float32)
    grown = _prefix_heads(3, reduced=20, randomize=False)
    assert all(k.startswith("prefix.") for k in warm_start(grown, tmp_path / "plain"))
    hidden, path = torch.randn(5, D), torch.randint(0, VOCAB, (5, 3))
    x, pos = _seq(5, 4)
    h = grown.prefix_forward(x, pos)[0][:, -1]
    assert torch.equal(h, x[:, -1])  # identity prefix layer
    assert torch.allclose(grown(h, path), trained(x[:, -1], path))
    assert torch.allclose(grown(hidden, path), trained(hidden, path))
    with pytest.raises(HydraMismatchError, match="num_layers is 1, this run's is 2"):
        warm_start(HydraHeads(replace(plain_cfg, num_layers=2), *_target(), token_map), tmp_path / "plain")
    with pytest.raises(HydraMismatchError, match="token map"):
        warm_start(HydraHeads(plain_cfg, *_target(), token_map + 1), tmp_path / "plain")
    save_heads(grown, tmp_path / "grown", torch.float32)
    with pytest.raises(HydraMismatchError, match="prefix layer"):
        warm_start(HydraHeads(plain_cfg, *_target(), token_map), tmp_path / "grown")
