"""The CPU linear routing (dyntree.common.linear): same products as F.linear, routed by row count
only inside an active dispatch, calibration cached on disk."""

from __future__ import annotations

import json
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dyntree.common import linear
from dyntree.common.linear import LinearDispatch


def _timings(fast_rows: dict[int, float]) -> dict[int, tuple[float, float]]:
    """F.linear costs 10 ms everywhere; the transposed product costs what ``fast_rows`` says
    (20 ms elsewhere)."""
    return {r: (10.0, fast_rows.get(r, 20.0)) for r in (1, 2, 4, 8, 16)}


def test_routing_picks_the_cheapest_calibrated_option() -> None:
    d = LinearDispatch(_timings({1: 5.0, 2: 5.0, 16: 6.0}))
    assert [d.pad_rows(m) for m in (1, 2)] == [2, 2]  # one row pads to two
    assert [d.pad_rows(m) for m in range(3, 17)] == [16] * 14  # 3..16 pad up to the fast 16
    assert d.pad_rows(17) == 0 and d.pad_rows(0) == 0  # beyond the calibration: F.linear
    assert LinearDispatch(_timings({})).summary() == "F.linear everywhere"
    with pytest.raises(ValueError, match="1 row"):
        LinearDispatch({2: (1.0, 1.0)})


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 13, 16, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_routed_products_equal_f_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 32, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    x = torch.randn(1, rows, 32, generator=g)
    want = F.linear(x, w, b)
    assert torch.equal(linear.linear(x, w, b), want)  # no dispatch active: F.linear itself
    d = LinearDispatch({r: (10.0, 1.0) for r in (1, 2, 4, 8, 16)})  # transposed everywhere it can
    with d.active():
        got = linear.linear(x, w, b)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_installed_modules_follow_the_active_dispatch_only() -> None:
    model = linear.install(nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 8, bias=False)))
    x = torch.randn(3, 16)
    with torch.no_grad():
        want = model[2](torch.relu(F.linear(x, model[0].weight, model[0].bias)))
        assert torch.equal(model(x), want)
        calls = []
        d = LinearDispatch({r: (10.0, 1.0) for r in (1, 2, 4)})
        real = d.linear
        d.linear = lambda *a: calls.append(a[0].shape) or real(*a)  # type: ignore[method-assign]
        with d.active():
            got = model(x)
            other = []
            t = threading.Thread(target=lambda: other.append(model(x)))  # another thread: not routed
            t.start()
            t.join()
        assert calls == [torch.Size([3, 16]), torch.Size([3, 24])]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(other[0], want)
        assert torch.equal(model(x), want)  # the block has ended


def test_calibration_is_cached_per_machine_and_shapes(tmp_path) -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))
    d = linear.calibrate(model, rows=(1, 2, 4), repeats=1, cache_dir=tmp_path)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and set(d.timings_ms) == {1, 2, 4}
    files[0].write_text(json.dumps({"1": [9.0, 1.0], "2": [9.0, 1.0], "4": [1.0, 9.0]}))
    cached = linear.calibrate(model, rows=(1, 2, 4), repeats=1, cache_dir=tmp_path)
    assert [cached.pad_rows(m) for m in (1, 2, 3, 4)] == [2, 2, 0, 0]
    files[0].write_text("not json")  # a damaged file is measured again and rewritten
    again = linear.calibrate(model, rows=(1, 2, 4), repeats=1, cache_dir=tmp_path)
    assert set(again.timings_ms) == {1, 2, 4} and json.loads(files[0].read_text())
    other = linear.calibrate(nn.Sequential(nn.Linear(16, 48)), rows=(1, 2, 4), repeats=1, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 2 and set(other.timings_ms) == {1, 2, 4}
