"""Tests for dyntree.common.quant: spec parsing, weight/activation quantization, QuantLinear."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dyntree.common.quant import (
    QSpec,
    QSpecError,
    QuantLinear,
    dequantize_weight,
    fake_quantize_activations,
    pack_int4,
    parse_qspec,
    quantize_weight,
    unpack_int4,
)


# -- spec parsing ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [
        (None, QSpec(8, None, None, True, 0)),
        ("", QSpec(8, None, None, True, 0)),
        ("asym", QSpec(8, None, None, False, 0)),
        ("w4a16", QSpec(4, None, 128, True, 0)),
        ("w8a16,g64", QSpec(8, None, 64, True, 0)),
        ("w4a8,asym", QSpec(4, 8, 128, False, 0)),
        ("W4A4, g32, sym, skip=3", QSpec(4, 4, 32, True, 3)),
        ("skip=2,w4a16,g128", QSpec(4, None, 128, True, 2)),
        ("w8a16,perchannel", QSpec(8, None, None, True, 0)),
        ("none", QSpec(None, None, None, True, 0)),
        ("none,skip=6", QSpec(None, None, None, True, 6)),
    ],
)
def test_parse_qspec_valid(text: str | None, expected: QSpec) -> None:
    spec = parse_qspec(text)
    assert spec == expected
    assert parse_qspec(str(spec)) == spec  # canonical text round-trips
    assert spec.quantized == (expected.weight_bits is not None)


@pytest.mark.parametrize(
    "text, match",
    [
        ("w3a16", "weight bits must be 4 or 8"),
        ("w4a2", "activation bits must be 4, 8 or 16"),
        ("g100", "group size must be a power of two.*got g100"),
        ("g16", "group size .*got g16"),
        ("g0", "group size .*got g0"),
        ("skip=-1", "skip must be a non-negative"),
        ("skip=two", "skip must be a non-negative"),
        ("w4a16,w8a16", "precision given twice"),
        ("g64,g128", "group size given twice"),
        ("sym,asym", "symmetry given twice"),
        ("none,g128", "'none' turns quantization off"),
        ("none,asym", "'none' turns quantization off"),
        ("none,w4a16", "precision given twice"),
        ("int4", "unknown field 'int4'"),
        ("w4a16,,g64", "empty field"),
    ],
)
def test_parse_qspec_errors_name_the_field(text: str, match: str) -> None:
    with pytest.raises(QSpecError, match=match) as info:
        parse_qspec(text)
    assert str(info.value).startswith("qspec: ")


def test_qspec_constructor_validates() -> None:
    with pytest.raises(QSpecError, match="activation quantization needs weight quantization"):
        QSpec(weight_bits=None, act_bits=8)
    with pytest.raises(QSpecError, match="got g48"):
        QSpec(group_size=48)


# -- int4 packing -------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 7, 64])
def test_pack_unpack_roundtrip(k: int) -> None:
    codes = torch.randint(0, 16, (5, k), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (5, (k + 1) // 2)
    assert torch.equal(packed[:, 0] & 0xF, codes[:, 0])  # element 0 sits in the low nibble
    assert torch.equal(unpack_int4(packed, k), codes)


def test_pack_rejects_out_of_range_and_unpack_checks_width() -> None:
    with pytest.raises(ValueError, match="0..15"):
        pack_int4(torch.tensor([[16]], dtype=torch.uint8))
    with pytest.raises(ValueError, match="expected ceil"):
        unpack_int4(torch.zeros(2, 3, dtype=torch.uint8), 8)


# -- weight quantization ------------------------------------------------------------------------
def _expanded(t: torch.Tensor, group: int, k: int) -> torch.Tensor:
    return t.float().repeat_interleave(group, dim=1)[:, :k]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 6),
    k=st.integers(1, 300),
    bits=st.sampled_from([4, 8]),
    symmetric=st.booleans(),
    group=st.sampled_from([32, 64, 128, None]),
    scale_dtype=st.sampled_from([torch.float16, torch.float32]),
    magnitude=st.sampled_from([1e-3, 0.05, 3.0]),
    shift=st.sampled_from([0.0, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_quantize_error_is_at_most_half_a_scale(
    n: int, k: int, bits: int, symmetric: bool, group: int | None, scale_dtype: torch.dtype,
    magnitude: float, shift: float, seed: int,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) + shift) * magnitude
    w[0, : k // 3] = 0.0  # an (partly) all-zero group must not divide by zero
    qw = quantize_weight(w, bits, group, symmetric, scale_dtype)
    g = k if group is None else group
    n_groups = math.ceil(k / g)
    assert qw.scales.shape == (n, n_groups) and qw.scales.dtype == scale_dtype
    assert qw.qweight.shape == (n, (k + 1) // 2 if bits == 4 else k)
    assert (qw.zeros is None) == symmetric
    if not symmetric:
        z = qw.zeros.float()
        assert torch.equal(z, z.round()) and bool((z >= 0).all()) and bool((z <= 2**bits - 1).all())
    deq = dequantize_weight(qw)
    step = _expanded(qw.scales, g, k)
    assert bool(((w - deq).abs() <= step * 0.5 * (1 + 1e-5) + 1e-9).all())
    assert bool((deq[0, : k // 3] == 0).all())  # zero stays exactly representable


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
def test_weights_on_the_grid_roundtrip_exactly(bits: int, symmetric: bool) -> None:
    # weights on a grid the quantizer can represent, with both ends of the code range present in
    # every group and power-of-two scales: it must recover that grid exactly (catches off-by-one
    # zero points and nibble order). Symmetric: codes in [-qmax, qmax]; asymmetric: codes in
    # [0, 2**bits - 1] minus an integral zero point per group.
    n, k, group = 4, 96, 32
    gen = torch.Generator().manual_seed(bits)
    if symmetric:
        lo, hi = -(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1
        zeros = torch.zeros(n, k // group)
    else:
        lo, hi = 0, 2**bits - 1
        zeros = torch.randint(0, hi + 1, (n, k // group), generator=gen).float()
    codes = torch.randint(lo, hi + 1, (n, k), generator=gen).float()
    codes[:, ::group] = hi
    codes[:, 1::group] = lo
    scales = 2.0 ** -torch.randint(2, 8, (n, k // group), generator=gen).float()
    w = (codes - _expanded(zeros, group, k)) * _expanded(scales, group, k)
    qw = quantize_weight(w, bits, group, symmetric, torch.float32)
    assert torch.equal(dequantize_weight(qw), w)


def test_finer_groups_give_smaller_error() -> None:
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(1)) * 0.02
    w[:, 7] *= 30  # an outlier input channel hurts coarse groups most
    errs = [(dequantize_weight(quantize_weight(w, 4, g)) - w).pow(2).mean().item() for g in (32, 128, None)]
    assert errs[0] < errs[1] < errs[2]
    err8 = (dequantize_weight(quantize_weight(w, 8, 128)) - w).pow(2).mean().item()
    assert err8 < errs[1] / 100  # 8 bit: 16x finer steps, ~256x smaller squared error


def test_quantize_weight_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        quantize_weight(torch.ones(2, 2), 3)
    with pytest.raises(ValueError, match="2-D"):
        quantize_weight(torch.ones(4), 4)
    with pytest.raises(ValueError, match="non-finite"):
        quantize_weight(torch.tensor([[1.0, float("nan")]]), 4)


def test_nbytes_counts_packed_codes_scales_and_zeros() -> None:
    w = torch.randn(10, 300)
    sym = quantize_weight(w, 4, 128, True, torch.float16)
    asym = quantize_weight(w, 4, 128, False, torch.float16)
    assert sym.nbytes == 10 * 150 + 10 * 3 * 2
    assert asym.nbytes == sym.nbytes + 10 * 3 * 2
    assert quantize_weight(w, 8, None).nbytes == 10 * 300 + 10 * 2


# -- activation quantization ---------------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 8])
def test_fake_quantized_activations_stay_within_half_a_token_step(bits: int) -> None:
    x = torch.randn(3, 5, 200, generator=torch.Generator().manual_seed(bits)) * torch.tensor([0.1, 1.0, 50.0]).view(3, 1, 1)
    x[0, 0] = 0.0  # an all-zero token is left at zero
    xq = fake_quantize_activations(x, bits)
    qmax = 2 ** (bits - 1) - 1
    step = x.abs().amax(dim=-1, keepdim=True) / qmax
    assert bool(((x - xq).abs() <= step * 0.5 * (1 + 1e-5) + 1e-12).all())
    assert bool((xq[0, 0] == 0).all())
    for row in xq.reshape(-1, 200)[1:]:
        assert row.unique().numel() <= 2 * qmax + 1
    assert fake_quantize_activations(x.half(), bits).dtype == torch.float16
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        fake_quantize_activations(x, 16)


# -- QuantLinear ---------------------------------------------------------------------------------
@pytest.mark.parametrize("spec_text", ["w4a16,g64", "w8a16,perchannel,asym", "w4a8,g32", "w4a4,asym"])
def test_quant_linear_matches_dequantized_linear(spec_text: str) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(192, 48, bias=True)
    spec = parse_qspec(spec_text)
    ql = QuantLinear.from_linear(lin, spec)
    assert ql.bias is lin.bias  # shared, not copied
    x = torch.randn(2, 3, 192)
    x_in = fake_quantize_activations(x, spec.act_bits) if spec.act_bits else x
    w = dequantize_weight(ql.quantized_weight)
    expected = F.linear(x_in, w, lin.bias)
    y = ql(x)
    assert y.shape == (2, 3, 48)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    # and it is a real approximation of the original layer
    rel = ((y - lin(x)).norm() / lin(x).norm()).item()
    assert rel < (0.35 if spec.act_bits == 4 else 0.12)


def test_quant_linear_errors_and_repr() -> None:
    lin = torch.nn.Linear(64, 8, bias=False)
    with pytest.raises(ValueError, match="'none' does not quantize"):
        QuantLinear.from_linear(lin, parse_qspec("none"))
    ql = QuantLinear.from_linear(lin, parse_qspec("w4a8,g32,asym"))
    assert "w4a8" in repr(ql) and "asym" in repr(ql)
    assert ql.nbytes == 8 * 32 + 2 * (8 * 2 * 2)
    with pytest.raises(ValueError, match="in_features 64"):
        ql(torch.randn(3, 65))
    with pytest.raises(ValueError, match="act_bits"):
        QuantLinear(ql.quantized_weight, act_bits=2)
