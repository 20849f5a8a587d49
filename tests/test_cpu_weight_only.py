"""Tests for the CPU weight-only kernels (dyntree.kernels.cpu_weight_only) against the torch
reference (dequantize, then matmul) and for how QuantLinear uses them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from dyntree.common.quant import QuantLinear, dequantize_weight, parse_qspec, quantize_weight
from dyntree.kernels import cpu_weight_only
from dyntree.kernels.cpu_weight_only import (CpuWeightOnly, FbgemmFp16, FbgemmInt8, cpu_kernels_available, cpu_weight_kernel,
                                             fp16_available, int8_available)

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="this torch lacks the CPU weight-only ops")


@pytest.mark.parametrize(
    "bits,group,symmetric",
    [(8, None, True), (8, None, False), (4, 32, True), (4, 64, False), (4, 128, True), (4, None, False)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_dequantized_reference(bits: int, group: int | None, symmetric: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 128) * 0.05
    w[:, :4] += 0.3  # skewed channels: asymmetric zero points away from the middle
    x = torch.randn(7, 128).to(dtype)
    qw = quantize_weight(w, bits, group, symmetric)
    prepared = CpuWeightOnly().prepare(qw)
    assert prepared is not None and prepared.bits == bits and prepared.extra_nbytes > 0
    y = CpuWeightOnly().matmul(x, prepared)
    assert y is not None and y.dtype == dtype and y.shape == (7, 96)
    ref = x.float() @ dequantize_weight(qw).t()
    # bf16 activations (and bf16 scales): ~3 significant digits
    assert float((y.float() - ref).abs().max()) < 0.02 * float(ref.abs().max())
    if not symmetric:  # the tolerance catches a zero point taken as the implicit one
        wrong = x.float() @ dequantize_weight(replace(qw, zeros=None)).t()
        assert float((wrong - ref).abs().max()) > 10 * float((y.float() - ref).abs().max())


@pytest.mark.parametrize(
    "bits,group,shape",
    [(8, 32, (96, 128)),  # int8 op: one scale per channel only
     (4, 32, (40, 128)),  # int4 op: N a multiple of 16
     (4, 64, (96, 96)),  # int4 op: the group divides K
     (4, 512, (96, 1024))],  # int4 op: groups 32..256
)
def test_weights_the_ops_cannot_take_are_refused(bits: int, group: int, shape: tuple[int, int]) -> None:
    assert CpuWeightOnly().prepare(quantize_weight(torch.randn(*shape), bits, group)) is None


def test_quant_linear_uses_the_kernel_and_falls_back() -> None:
    torch.manual_seed(1)
    lin = nn.Linear(128, 96, bias=True)
    x = torch.randn(2, 3, 128)
    ref_layer = QuantLinear.from_linear(lin, parse_qspec("w4a16,g32"))
    fast = QuantLinear.from_linear(lin, parse_qspec("w4a16,g32"), kernel=CpuWeightOnly())
    assert ref_layer.kernel is None and isinstance(fast.kernel, CpuWeightOnly) and "kernel=" in repr(fast)
    assert fast.nbytes > ref_layer.nbytes  # the packed copy is counted
    ref, y = ref_layer(x), fast(x)
    assert y.shape == ref.shape and not torch.equal(y, ref)  # bf16 activations: close, not equal
    torch.testing.assert_close(y, ref, atol=0.02, rtol=0.02)
    # activation quantization and grouped int8 stay on the reference path
    assert QuantLinear.from_linear(lin, parse_qspec("w4a8,g32"), kernel=CpuWeightOnly()).kernel is None
    assert QuantLinear.from_linear(lin, parse_qspec("w8a16,g32"), kernel=CpuWeightOnly()).kernel is None
    # materialize: the reference numbers again (dense copy, kernel dropped)
    fast.materialize(torch.float32)
    assert fast.kernel is None and torch.equal(fast(x), ref)


def test_released_codes_leave_only_the_kernel_copy() -> None:
    lin = nn.Linear(128, 96)
    layer = QuantLinear.from_linear(lin, parse_qspec("w8a16,perchannel"), kernel=CpuWeightOnly())
    x = torch.randn(3, 128)
    before, y = layer.nbytes, layer(x)
    layer.release_codes()
    assert layer.nbytes == before - 96 * 128 - 96 * 2  # uint8 codes and fp16 scales gone
    assert torch.equal(layer(x), y)
    with pytest.raises(ValueError, match="released"):
        layer.materialize(torch.float32)
    with pytest.raises(ValueError, match="no kernel"):
        QuantLinear.from_linear(lin, parse_qspec("w8a16,g32"), kernel=CpuWeightOnly()).release_codes()


@pytest.mark.skipif(not int8_available(), reason="torch without FBGEMM")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fbgemm_int8_matches_the_reference_and_serves_only_symmetric_per_channel_int8(dtype: torch.dtype) -> None:
    """FBGEMM's dynamic int8 GEMM as a kernel: within its 7-bit input quantization of the
    dequantized reference, fp32 compute, the caller's dtype out; grouped, asymmetric and 4-bit
    weights are refused (the layer then dequantizes)."""
    torch.manual_seed(0)
    w, x = torch.randn(96, 128) * 0.05, torch.randn(7, 128).to(dtype)
    qw = quantize_weight(w, 8, None, True)
    kernel = FbgemmInt8()
    prepared = kernel.prepare(qw)
    assert prepared is not None and prepared.extra_nbytes == 96 * 128 and kernel.compute_dtype(dtype) == torch.float32
    y = kernel.matmul(x, prepared)
    assert y is not None and y.dtype == dtype and y.shape == (7, 96)
    ref = x.float() @ dequantize_weight(qw).t()
    err = float((y.float() - ref).abs().max())
    assert 0 < err < 0.03 * float(ref.abs().max())  # the input is quantized: close, not equal
    assert kernel.matmul(x[None], prepared) is None  # rows only
    for refused in (quantize_weight(w, 8, 32, True), quantize_weight(w, 8, None, False), quantize_weight(w, 4, 32, True)):
        assert kernel.prepare(refused) is None
    layer = QuantLinear(qw, None, kernel=kernel)
    assert layer.kernel is kernel and torch.equal(layer(x), y)


@pytest.mark.skipif(not fp16_available(), reason="torch without FBGEMM")
@pytest.mark.parametrize("bits,group,symmetric", [(8, None, True), (8, 32, False), (4, 64, True), (4, None, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fbgemm_fp16_serves_any_quantized_weight_as_its_fp16_dequantization(bits: int, group: int | None,
                                                                             symmetric: bool, dtype: torch.dtype) -> None:
    """FBGEMM's fp16 GEMM as a kernel: the dequantized weight rounded to fp16 times fp32 inputs
    (fp16's 11 bits, far inside the int8 grid's step), every grid, the caller's dtype out."""
    torch.manual_seed(0)
    w, x = torch.randn(96, 128) * 0.05, torch.randn(7, 128)
    w[:, :4] += 0.3
    qw = quantize_weight(w, bits, group, symmetric)
    kernel = FbgemmFp16()
    prepared = kernel.prepare(qw)
    assert prepared is not None and prepared.extra_nbytes == 2 * 96 * 128 and kernel.compute_dtype(dtype) == torch.float32
    y = kernel.matmul(x.to(dtype), prepared)
    assert y is not None and y.dtype == dtype and y.shape == (7, 96)
    ref = x @ dequantize_weight(qw).t()
    fp16_ref = x @ dequantize_weight(qw).half().float().t()
    if dtype == torch.float32:  # exactly the fp16 weights' product, up to summation order
        torch.testing.assert_close(y, fp16_ref, rtol=1e-5, atol=1e-5)
    # the int8 grid's half step is ~0.4% of a weight's range; fp16 rounding ~0.05% (bf16 in/out: ~0.4%)
    assert float((y.float() - ref).abs().max()) < (0.001 if dtype == torch.float32 else 0.02) * float(ref.abs().max())
    assert kernel.matmul(x[None], prepared) is None  # rows only
    layer = QuantLinear(qw, None, kernel=kernel)
    layer.release_codes()
    assert layer.kernel is kernel and torch.equal(layer(x), kernel.matmul(x, prepared))


@pytest.mark.parametrize("native_bf16", [True, False])
def test_the_cpu_weight_kernel_follows_the_cpus_bf16(monkeypatch, native_bf16: bool) -> None:
    """int8 weights take FBGEMM's fp16 GEMM on a CPU without native bf16 (torch's int8 op computes
    in emulated bf16 there), torch's weight-only op on one with it; int4 keeps torch's op; no
    kernel off the CPU."""
    monkeypatch.setattr(cpu_weight_only, "cpu_has_native_bf16", lambda: native_bf16)
    cpu = torch.device("cpu")
    int8 = cpu_weight_kernel(cpu)
    assert type(int8) is (CpuWeightOnly if native_bf16 or not fp16_available() else FbgemmFp16)
    assert type(cpu_weight_kernel(cpu, bits=4)) is CpuWeightOnly
    assert cpu_weight_kernel(torch.device("meta")) is None
