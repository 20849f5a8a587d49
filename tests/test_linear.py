"""The CPU linear routing (dyntree.kernels.cpu_linear): same products as F.linear, routed by row count
only inside an active dispatch, calibration cached on disk."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dyntree.kernels import cpu_linear as linear
from dyntree.kernels.cpu_linear import LINEAR, PACKED, TRANSPOSED, LinearDispatch, LinearRouter, PackedWeight


def _timings(fast_rows: dict[int, float]) -> dict[int, tuple[float, float]]:
    """F.linear costs 10 ms everywhere; the transposed product costs what ``fast_rows`` says
    (20 ms elsewhere)."""
    return {r: (10.0, fast_rows.get(r, 20.0)) for r in (1, 2, 4, 8, 16)}


def test_routing_picks_the_cheapest_calibrated_option() -> None:
    d = LinearDispatch(_timings({1: 5.0, 2: 5.0, 16: 6.0}))
    assert [d.route(m) for m in (1, 2)] == [(TRANSPOSED, 2)] * 2  # one row pads to two
    assert [d.route(m) for m in range(3, 17)] == [(TRANSPOSED, 16)] * 14  # 3..16 pad up to the fast 16
    assert d.route(17) == (LINEAR, 17) and d.route(0) == (LINEAR, 0)  # beyond the calibration: F.linear
    assert not d.packs  # no packed timings: never routed there
    assert LinearDispatch(_timings({})).summary() == "F.linear everywhere"
    with pytest.raises(ValueError, match="1 row"):
        LinearDispatch({2: (1.0, 1.0)})


def test_packed_route_runs_at_the_row_count_and_only_for_packed_weights() -> None:
    # rows -> F.linear, transposed, packed (the one copy packed for PACK_ROWS rows) ms
    t = {1: (10.0, 15.0, 11.0), 2: (10.0, 15.0, 11.0), 4: (20.0, 15.0, 11.0), 8: (30.0, 16.0, 12.0),
         16: (40.0, 18.0, 13.0), 32: (60.0, 30.0, 20.0)}
    d = LinearDispatch(t)
    assert d.packs and "MKL packed GEMM for rows 3-32" in d.summary()
    assert [d.route(m) for m in (1, 2, 3, 8, 9, 17, 33)] == [
        (LINEAR, 1), (LINEAR, 2), (PACKED, 3), (PACKED, 8), (PACKED, 9), (PACKED, 17), (LINEAR, 33)]
    # without a packed copy: the best of F.linear and the transposed product
    assert [d.route(m, packed=False) for m in (1, 3, 9)] == [(LINEAR, 1), (TRANSPOSED, 4), (TRANSPOSED, 16)]
    assert d.steps() == [2, 3]  # the packed form runs unpadded: its cost has no steps of its own
    assert not LinearDispatch({r: ms[:2] for r, ms in t.items()}).packs  # no packed timings: never packed
    with pytest.raises(ValueError, match="up to"):
        LinearDispatch({1: (1.0, 1.0), linear.PACK_ROWS + 1: (1.0, 1.0)})


def test_router_routes_only_while_its_owner_sets_a_dispatch() -> None:
    """Installed linears follow their router: stock ``F.linear`` with no dispatch set, the
    dispatch within :meth:`LinearRouter.using`, the outer one again after a nested block (the
    engine turns routing off for forwards whose row count takes ``F.linear`` anyway)."""
    t = {1: (10.0, 15.0, 11.0), 2: (10.0, 15.0, 11.0), 4: (20.0, 15.0, 11.0), 8: (30.0, 16.0, 12.0)}
    d = LinearDispatch(t)
    router = LinearRouter()
    model = linear.install(nn.Sequential(nn.Linear(16, 24)), router)
    assert model[0]._dyntree_router is router and router.dispatch is None
    with router.using(d):
        assert router.dispatch is d
        with router.using(None):
            assert router.dispatch is None
        assert router.dispatch is d  # restored after each block
    assert router.dispatch is None
    calls = []
    d.linear = lambda *a: calls.append(a) or F.linear(*a[:3])  # type: ignore[method-assign]
    x = torch.randn(4, 16)
    model(x)
    assert not calls  # no dispatch set: F.linear itself
    with router.using(d):
        model(x)
    assert len(calls) == 1


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 13, 16, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_routed_products_equal_f_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 32, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    x = torch.randn(1, rows, 32, generator=g)
    want = F.linear(x, w, b)
    assert torch.equal(LinearRouter().linear(x, w, b), want)  # no dispatch set: F.linear itself
    timings = [{r: (10.0, 1.0) for r in (1, 2, 4, 8, 16)}]  # transposed everywhere it can
    if linear.mkl_packed_available():
        timings.append({r: (10.0, 5.0, 1.0) for r in (1, 2, 4, 8, 16)})  # packed everywhere it can
    for t in timings:
        d = LinearDispatch(t)
        packed = PackedWeight(w) if d.packs else None
        got = LinearRouter(d).linear(x, w, b, packed)
        assert got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not linear.mkl_packed_available(), reason="needs torch with MKL")
@pytest.mark.parametrize("shape", [(40, 24), (576, 576), (192, 1536)])
def test_one_packed_copy_serves_every_row_count(shape: tuple[int, int]) -> None:
    """What the single packed copy rests on: packed once, it computes products of any row count up
    to PACK_ROWS like F.linear (MKL documents it for the row count it was packed for)."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(*shape, generator=g), torch.randn(shape[0], generator=g)
    x = torch.randn(linear.PACK_ROWS, shape[1], generator=g)
    packed = PackedWeight(w)
    d = LinearDispatch({r: (10.0, 20.0, 1.0) for r in (1, 2, 4, 8, 16, 64)})
    router = LinearRouter(d)
    with torch.inference_mode():
        for m in range(1, linear.PACK_ROWS + 1):
            assert d.route(m) == (PACKED, m)
            torch.testing.assert_close(router.linear(x[:m], w, b, packed), F.linear(x[:m], w, b), rtol=1e-5, atol=1e-4)


def test_calibration_never_routes_to_a_packed_copy_that_disagrees(monkeypatch, tmp_path) -> None:
    if not linear.mkl_packed_available():
        pytest.skip("needs torch with MKL")
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))
    right = linear._packed
    monkeypatch.setattr(linear, "_packed", lambda x, w, p, b: right(x, w, p, b) * (1.0 if x.shape[0] < 3 else 1.01))
    d = linear.calibrate(model, rows=(1, 2, 4), repeats=1, cache_dir=tmp_path)
    assert not d.packs and all(len(ms) == 2 for ms in json.loads(next(tmp_path.glob("*.json")).read_text()).values())
    monkeypatch.setattr(linear, "_packed", right)
    assert len(linear.calibrate(model, rows=(1, 2, 4), repeats=1).timings_ms[4]) == 3


@pytest.mark.skipif(not linear.mkl_packed_available(), reason="needs torch with MKL")
def test_packed_copy_follows_in_place_changes() -> None:
    router = LinearRouter()
    model = linear.install(nn.Sequential(nn.Linear(16, 24)), router, packed=True)
    lin = model[0]
    x = torch.randn(5, 16)
    d = LinearDispatch({1: (10.0, 20.0, 20.0), 8: (10.0, 20.0, 1.0)})
    assert d.route(5) == (PACKED, 5)
    with torch.no_grad(), router.using(d):
        torch.testing.assert_close(model(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        lin.weight.mul_(2.0)  # in place: repacked
        torch.testing.assert_close(model(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        lin.weight.data = torch.randn(24, 16)  # new storage: repacked as well
        torch.testing.assert_close(model(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not linear.mkl_packed_available(), reason="needs torch with MKL")
def test_a_model_with_packed_copies_deep_copies() -> None:
    import copy

    router = LinearRouter()
    model = linear.install(nn.Sequential(nn.Linear(16, 24)), router, packed=True)
    x = torch.randn(5, 16)
    d = LinearDispatch({1: (10.0, 20.0, 20.0), 8: (10.0, 20.0, 1.0)})
    with torch.no_grad(), router.using(d):
        model(x)  # the packed copy exists now (an MKL tensor, which deepcopy cannot copy)
        twin = copy.deepcopy(model)
        assert twin[0]._dyntree_packed.weight is twin[0].weight
        twin[0].weight.mul_(2.0)  # the copy packs its own weight, not the original's
        torch.testing.assert_close(twin(x), F.linear(x, twin[0].weight, twin[0].bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(x), F.linear(x, model[0].weight, model[0].bias), rtol=1e-5, atol=1e-5)


def test_calibration_is_cached_per_machine_and_shapes(tmp_path) -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))
    d = linear.calibrate(model, rows=(1, 2, 4), repeats=1, cache_dir=tmp_path)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and set(d.timings_ms) == {1, 2, 4}
    files[0].write_text(json.dumps({"1": [9.0, 1.0, 9.0], "2": [9.0, 1.0, 9.0], "4": [1.0, 9.0, 9.0]}))
    cached = linear.calibrate(model, rows=(1, 2, 4), repeats=1, cache_dir=tmp_path)
    assert [cached.route(m)[0] for m in (1, 2, 3, 4)] == [TRANSPOSED, TRANSPOSED, LINEAR, LINEAR]
    files[0].write_text("not json")  # a damaged file is measured again and rewritten
    again = linear.calibrate(model, rows=(1, 2, 4), repeats=1, cache_dir=tmp_path)
    assert set(again.timings_ms) == {1, 2, 4} and json.loads(files[0].read_text())
    other = linear.calibrate(nn.Sequential(nn.Linear(16, 48)), rows=(1, 2, 4), repeats=1, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 2 and set(other.timings_ms) == {1, 2, 4}
