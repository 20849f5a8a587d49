"""The engine's attention (dyntree.kernels.cpu_attention, dyntree.standalone.attention): three K/V-copy-free
implementations equal to repeat-KV attention, routed by a calibration cached on disk, active only
inside the engine's scope; on the real model each one decodes exactly what transformers'
``generate()`` does (fp32)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dyntree.kernels import cpu_attention as attention
from dyntree.kernels.cpu_attention import IMPLS, AttentionDispatch, attend
from dyntree.common.config import SamplingParams, SpecConfig
from dyntree.common.drafters import make_drafter
from dyntree.standalone import attention as engine_attention
from dyntree.standalone.engine import SpecEngine


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Textbook attention with each KV head repeated per query group."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    w = torch.softmax(q @ k.transpose(-1, -2) * scale + mask, dim=-1)
    return w @ v


def _case(batch: int, query: int, cached: int, seed: int = 0):
    """GQA 6/2 heads; row 1 sees fewer cached tokens (a padded batch); the queries form a tree
    (node i sees its ancestors: i's parent is (i - 1) // 2)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 6, query, 16, generator=g)
    k = torch.randn(batch, 2, cached + query, 16, generator=g)
    v = torch.randn(batch, 2, cached + query, 16, generator=g)
    tree = torch.eye(query, dtype=torch.bool)
    for i in range(1, query):
        tree[i] |= tree[(i - 1) // 2]
    allowed = torch.cat([torch.ones(batch, query, cached, dtype=torch.bool), tree.expand(batch, query, query)], -1)
    allowed[1:, :, cached // 2 : cached] = False
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)[:, None]
    return q, k, v, mask


@pytest.mark.parametrize("name", sorted(IMPLS))
@pytest.mark.parametrize("shape", [(1, 1, 9), (1, 7, 30), (2, 7, 30), (3, 1, 50)])
def test_every_implementation_equals_repeated_kv_attention(name: str, shape: tuple[int, int, int]) -> None:
    q, k, v, mask = _case(*shape)
    want = _reference(q, k, v, mask, 0.25)
    got = IMPLS[name](q, k, v, mask, 0.25)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if (mask < 0).any():  # control: the mask is honoured (dropping it changes the result)
        assert not torch.allclose(IMPLS[name](q, k, v, torch.zeros_like(mask), 0.25), want, atol=1e-3)


def test_dispatch_picks_the_fastest_at_the_nearest_grid_point() -> None:
    timings = {(b, q, kv): {"gqa": 10.0, "rows": 5.0 if q == 1 else 20.0, "matmul": 1.0 if kv >= 1024 else 30.0}
               for b in (1, 16) for q in (1, 16) for kv in (64, 1024)}
    d = AttentionDispatch(timings)
    assert d.pick(1, 1, 64) == "rows" and d.pick(2, 1, 100) == "rows"  # nearest: (1, 1, 64)
    assert d.pick(1, 8, 64) == "gqa"  # 8 is nearer 16 than 1 in log scale
    assert d.pick(12, 3, 700) == "matmul" and d.pick(1, 1, 50_000) == "matmul"  # beyond the grid: its edge
    assert d.pick(1, 33, 64) == "gqa"  # a prefill (over twice the largest query rows): fused, never the score matrix
    assert "matmul at 4 of 8" in d.summary()
    with pytest.raises(ValueError, match="unknown attention implementation"):
        AttentionDispatch({(1, 1, 1): {"flash": 1.0}})
    with pytest.raises(ValueError, match="needs timings"):
        AttentionDispatch({})


def test_attend_follows_the_dispatch_it_is_given_only(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v, mask = _case(1, 3, 20)
    calls: list[str] = []
    for name, fn in list(IMPLS.items()):
        monkeypatch.setitem(IMPLS, name, lambda *a, _n=name, _f=fn: calls.append(_n) or _f(*a))
    attend(q, k, v, mask, 0.25)
    d = AttentionDispatch({(1, q, 64): {"gqa": 9.0, "rows": 9.0, "matmul": 1.0} for q in (1, 4)})
    attend(q, k, v, mask, 0.25, d)
    attend(q, k, v, mask, 0.25)
    assert calls == ["gqa", "matmul", "gqa"]
    attend(q[:, :, :1], k, v, None, 0.25, d)  # one query row without a mask: the calibrated pick ...
    attend(q, k, v, None, 0.25, d)  # several rows without a mask: the calibrated pick
    slow_matmul = AttentionDispatch({(1, q, 64): {"gqa": 1.0, "rows": 9.0, "matmul": 20.0} for q in (1, 4)})
    attend(q[:, :, :1], k, v, None, 0.25, slow_matmul)  # ... except gqa: one unmasked row takes the stacked-rows form
    assert calls[3:] == ["matmul", "matmul", "rows"]


def test_calibration_is_cached_per_shape_and_grid(tmp_path) -> None:
    grid = ((1, 2), (1, 4), (16, 32))
    d = attention.calibrate(6, 2, 16, torch.float32, repeats=1, cache_dir=tmp_path, grid=grid)
    files = list(tmp_path.glob("attention-*.json"))
    assert len(files) == 1 and set(d.timings_us) == {(b, q, kv) for b in grid[0] for q in grid[1] for kv in grid[2]}
    assert all(set(t) == set(IMPLS) and all(math.isfinite(x) and x > 0 for x in t.values()) for t in d.timings_us.values())
    fake = {k: {"gqa": 3.0, "rows": 2.0, "matmul": 1.0} for k in json.loads(files[0].read_text())}
    files[0].write_text(json.dumps(fake))  # a cached file is read, not re-measured
    assert attention.calibrate(6, 2, 16, torch.float32, cache_dir=tmp_path, grid=grid).pick(1, 1, 16) == "matmul"
    files[0].write_text("{not json")  # a damaged file is re-measured and rewritten
    attention.calibrate(6, 2, 16, torch.float32, repeats=1, cache_dir=tmp_path, grid=grid)
    assert json.loads(files[0].read_text()).keys() == fake.keys()
    attention.calibrate(6, 2, 16, torch.float32, repeats=1, cache_dir=tmp_path, grid=((1,), (1,), (16,)))
    assert len(list(tmp_path.glob("attention-*.json"))) == 2


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(IMPLS))
def test_engine_with_each_attention_equals_transformers_generate(smol, smol_prompts, name: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain decoding (batch 1, one-token forwards unmasked) and n-gram trees (batch 2) with every
    attention forced equal transformers' own greedy ``generate()`` (sdpa) in fp32; the model's
    attention is restored."""
    model, tok = smol
    prompts, new = smol_prompts[:4], 24
    params = SamplingParams(max_new_tokens=new)
    eos = sorted(SpecEngine(model, tok, make_drafter("none"), SpecConfig(drafter="none")).eos_ids(params))
    want = []
    with torch.inference_mode():
        for p in prompts:
            x = torch.tensor([p])
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos[0])
            want.append(out[0, len(p):].tolist())
    forced = AttentionDispatch({(1, q, 64): {n: (1.0 if n == name else 9.0) for n in IMPLS} for q in (1, 64)})
    unmasked: list[int] = []  # query rows of the calls without a mask
    real = engine_attention.attend
    monkeypatch.setattr(engine_attention, "attend",
                        lambda q, k, v, m, s, d=None: (m is None and unmasked.append(q.shape[2])) or real(q, k, v, m, s, d))
    for drafter, spec, batch in (("none", SpecConfig(drafter="none"), 1), ("ngram", SpecConfig(max_nodes=8), 2)):
        engine = SpecEngine(model, tok, make_drafter(drafter), spec)
        engine.attention = forced
        got = []
        for i in range(0, len(prompts), batch):
            got += [o.token_ids for o in engine.generate(prompts[i:i + batch], params)]
        assert got == want, f"{name}, {drafter}: differs from transformers generate()"
        assert model.config._attn_implementation == "sdpa"
        if drafter == "none":  # plain decoding at batch 1 attends unmasked, one row at a time
            assert len(unmasked) == model.config.num_hidden_layers * sum(len(w) - 1 for w in want)
            assert set(unmasked) == {1}


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("sizes", [[1, 4, 1, 3], [1, 4, 1, 1, 1], [3, 3], [1, 1, 1]])
def test_ragged_attention_equals_padded_attention_per_row(sizes: list[int], split: bool) -> None:
    # A ragged verify: the rows' trees back to back as one [1, H, N, D] sequence. The cache
    # scatters their KV to each row's slots [S, S + T) and the engine's attention attends every
    # query over its own row: equal, on the valid tokens, to the padded [B, T] batch, whether it
    # attends padded or split (roots batched, each wide row alone; timings that make it pay).
    from dyntree.standalone import kv

    grid = {(b, q, n): {"gqa": 1.0 if b == 1 or q == 1 else 1e6} for b in (1, 4) for q in (1, 4) for n in (16, 64)}
    dispatch = AttentionDispatch(grid) if split else None
    assert engine_attention._split_pays(kv.RaggedLayout.from_indptr(torch.tensor([0, 1, 5, 6, 7])), 16, None) is False
    assert engine_attention._split_pays(kv.RaggedLayout.from_indptr(torch.tensor([0, 1, 5, 6, 7])), 16, dispatch) is split

    b, t, cached = len(sizes), max(sizes), 12
    q, k, v, mask = _case(b, t, cached, seed=len(sizes))
    layout = kv.RaggedLayout.from_indptr(torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()]))
    valid = torch.arange(t)[None] < torch.tensor(sizes)[:, None]
    assert layout.width == t and layout.uniform == (min(sizes) == t)
    flat = lambda x: x.transpose(1, 2)[valid].transpose(0, 1)[None]  # noqa: E731  [B, H, T, D] -> [1, H, N, D]
    cache = kv.GrowingCache()
    cache.update(k[:, :, :cached], v[:, :, :cached], 0)
    with kv.ragged(cache, layout):
        keys, values = cache.update(flat(k[:, :, cached:]), flat(v[:, :, cached:]), 0)
    torch.testing.assert_close(keys.transpose(1, 2)[:, cached:][valid], k.transpose(1, 2)[:, cached:][valid])
    assert keys.shape == k.shape
    want = _reference(q, k, v, mask, 0.25).transpose(1, 2)[valid]  # [N, H, D]
    module = torch.nn.Module()
    module.num_key_value_groups, module.layer_idx, module.is_causal = 3, 0, False
    passed = {engine_attention.LAYOUT: layout, engine_attention.DISPATCH: dispatch}
    got, _ = engine_attention._engine_attention(module, flat(q), keys, values, mask, scaling=0.25, **passed)
    # the same through transformers' sdpa, where the engine's attention does not apply (no scaling
    # given: sdpa's default 1 / sqrt(16))
    fallback, _ = engine_attention._engine_attention(module, flat(q), keys, values, mask, **passed)
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fallback[0], want, rtol=1e-5, atol=1e-5)
    if layout.uniform:
        return
    swapped = torch.tensor([0, *torch.tensor(sizes[::-1]).cumsum(0).tolist()])
    wrong, _ = engine_attention._engine_attention(  # control: the rows' tokens assigned the other way round
        module, flat(q), keys, values, mask, scaling=0.25,
        **{**passed, engine_attention.LAYOUT: kv.RaggedLayout.from_indptr(swapped)})
    assert not torch.allclose(wrong, got, atol=1e-3)
