"""The engine's KV cache: in-place appends into a buffer with headroom, equal to transformers'
concatenating ``DynamicCache`` under every surgery the engine does."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from dyntree.standalone import kv


def _kv(b: int, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 2, t, 4, generator=g), torch.randn(b, 2, t, 4, generator=g)


def test_growing_cache_equals_dynamic_cache_under_engine_surgery() -> None:
    grow, ref = kv.GrowingCache(), DynamicCache()
    seed = 0

    def append(t: int) -> None:
        nonlocal seed
        seed += 1
        b = ref.layers[0].keys.shape[0] if ref.layers else 3
        for layer in range(2):
            k, v = _kv(b, t, seed * 10 + layer)
            got, want = grow.update(k, v, layer), ref.update(k, v, layer)
            assert all(torch.equal(x, y) for x, y in zip(got, want))

    def same() -> None:
        for g, r in zip(grow.layers, ref.layers, strict=True):
            assert torch.equal(g.keys, r.keys) and torch.equal(g.values, r.values)
        assert kv.seq_len(grow) == kv.seq_len(ref)

    append(5)
    ptr = grow.layers[0].keys.data_ptr()
    for t in (1, 4, 2):  # verify forwards append in place: no copy of the cached tokens
        append(t)
        assert grow.layers[0].keys.data_ptr() == ptr
    same()
    for c in (grow, ref):  # compaction, then the crop to the longest row
        kv.compact(c, torch.tensor([0, 2]), torch.tensor([10, 11]), torch.tensor([6, 5]))
        kv.crop(c, 8)
    same()
    append(3)
    assert grow.layers[0].keys.data_ptr() == ptr  # the crop's view still leads the buffer
    same()
    append(200)  # past the headroom: a bigger buffer, the content carried over
    assert grow.layers[0].keys.data_ptr() != ptr
    same()
    for c in (grow, ref):  # a request leaves, another joins (padded to the longer side)
        kv.select_rows(c, torch.tensor([0, 2]))
        new = DynamicCache()
        for layer in range(2):
            new.update(*_kv(1, 7, 99 + layer), layer)
        kv.append_rows(c, new)
    append(2)
    same()
    ptr = grow.layers[1].values.data_ptr()
    append(1)
    assert grow.layers[1].values.data_ptr() == ptr
    same()
