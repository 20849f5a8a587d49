"""Weight-only int8 / int4 matmuls on CPU through torch's own kernels.

:func:`cpu_weight_kernel` is the :class:`~dyntree.common.quant.WeightKernel` every engine hands to
its drafters' quantized layers (the self-draft's, the Hydra heads') on a CPU: :class:`CpuWeightOnly`,
except for int8 weights on a CPU that does not compute bf16 natively: :class:`FbgemmFp16`.

:class:`CpuWeightOnly` repacks a
:class:`~dyntree.kernels.quant_format.QuantizedWeight` once, at build time, for

* ``aten._weight_int8pack_mm`` (int8, one scale per output channel): signed codes ``u - 128``
  (symmetric) or ``u - 128`` plus a per-channel offset ``(128 - z) * s`` applied as a rank-one
  correction ``sum_k(x) * offset`` (asymmetric);
* ``aten._weight_int4pack_mm_for_cpu`` (int4, group size 32..256 dividing ``K``, ``N`` a
  multiple of 16): the kernel computes ``(u - 8) * s + m`` per group, so symmetric weights get
  ``m = 0`` and asymmetric ones ``m = (8 - z) * s``.

Both run with bf16 activations (their fp32 paths are several times slower here): the draft's
fp32 activations are rounded to bf16 around each matmul and the result is cast back. That
changes the draft's numbers slightly, never the output (the target verifies every token).
Weights the ops cannot take (grouped int8, other group sizes or shapes) get ``None`` from
:meth:`CpuWeightOnly.prepare` and the layer dequantizes on the fly. The readable reference is
:func:`~dyntree.kernels.quant_format.dequantize_weight` followed by a matmul.

:class:`FbgemmInt8` is the other CPU int8 kernel: FBGEMM's dynamic int8 GEMM
(``torch.ops.quantized.linear_dynamic``), for symmetric per-channel int8 weights. It quantizes
its input per call to 7 bits (``reduce_range``: full 8-bit activations saturate AVX2's int8
multiply-add and cost ~10% of the logits' range in error, against ~1-2%) and computes in fp32,
so a draft's fp32 rows (the Hydra heads' output rows) read a quarter of the weight's fp32 bytes.

:class:`FbgemmFp16` serves a quantized weight (any bits and grid) as its dequantization rounded to
fp16, through FBGEMM's fp16 GEMM (``torch.ops.quantized.linear_dynamic_fp16``): fp32
activations and accumulation, half the fp32 weight's bytes (twice int8's). On a CPU without native
bf16 the ops above round the activations to an emulated bf16 and their int8 path runs far from the
memory bound; the fp16 GEMM computes the same products (the draft's weights, to fp16's 11 bits)
faster at the 1-16 rows measured (``docs/measurements.md``, CPU drafting kernels).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from dyntree.kernels.cpu_linear import cpu_has_native_bf16
from dyntree.kernels.quant_format import QuantizedWeight, dequantize_weight, unpack_int4

__all__ = ["CpuWeightOnly", "FbgemmFp16", "FbgemmInt8", "cpu_kernels_available", "cpu_weight_kernel", "fp16_available",
           "int8_available"]

_INT4_GROUPS = (32, 64, 128, 256)


def cpu_kernels_available() -> bool:
    """Whether this torch has the CPU weight-only ops."""
    ops = torch.ops.aten
    return all(hasattr(ops, n) for n in ("_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu",
                                         "_convert_weight_to_int4pack_for_cpu"))


def int8_available() -> bool:
    """Whether this torch has FBGEMM's dynamic int8 linear (x86 CPUs): :class:`FbgemmInt8`."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(torch.ops.quantized, "linear_dynamic")


def fp16_available() -> bool:
    """Whether this torch has FBGEMM's fp16 linear (x86 CPUs): :class:`FbgemmFp16`."""
    ops = torch.ops.quantized
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(ops, "linear_prepack_fp16") \
        and hasattr(ops, "linear_dynamic_fp16")


def cpu_weight_kernel(device: torch.device, bits: int = 8) -> "CpuWeightOnly | FbgemmFp16 | None":
    """The weight kernel an engine offers its drafters' ``bits``-bit weights on ``device``: torch's
    weight-only ops, except int8 weights on a CPU without native bf16 (no AMX or AVX512-BF16),
    which take FBGEMM's fp16 GEMM (int4 keeps its op there: a quarter of fp16's bytes, what int4 is
    asked for); ``None`` off the CPU or where this torch has neither."""
    if device.type != "cpu":
        return None
    if bits == 8 and not cpu_has_native_bf16() and fp16_available():
        return FbgemmFp16()
    return CpuWeightOnly() if cpu_kernels_available() else None


@dataclass(frozen=True)
class CpuPacked:
    """One weight in the layout of torch's CPU op (see the module docstring)."""

    bits: int
    weight: torch.Tensor  # int8 [N, K] codes, or the int4 op's packed layout
    scales: torch.Tensor  # bf16: [N] (int8) or [K / group, N, 2] scale and min (int4)
    offset: torch.Tensor | None  # int8 asymmetric: fp32 [N] per-channel offset
    group_size: int

    @property
    def extra_nbytes(self) -> int:
        tensors = [self.weight, self.scales] + ([self.offset] if self.offset is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


class CpuWeightOnly:
    """Torch's CPU weight-only kernels as a ``WeightKernel`` (see the module docstring)."""

    def prepare(self, qw: QuantizedWeight) -> CpuPacked | None:
        if qw.qweight.device.type != "cpu" or not cpu_kernels_available():
            return None
        n, k = qw.out_features, qw.in_features
        scales = qw.scales.float()
        if qw.bits == 8:
            if qw.n_groups != 1:
                return None
            codes = (qw.qweight.to(torch.int16) - 128).to(torch.int8).contiguous()
            offset = None if qw.zeros is None else ((128 - qw.zeros[:, 0].float()) * scales[:, 0]).contiguous()
            return CpuPacked(8, codes, scales[:, 0].to(torch.bfloat16).contiguous(), offset, k)
        if qw.group_size not in _INT4_GROUPS or k % qw.group_size or n % 16:
            return None
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(qw.qweight, k).to(torch.int32), 2)
        mins = torch.zeros_like(scales) if qw.zeros is None else (8 - qw.zeros.float()) * scales
        scale_min = torch.stack((scales.t(), mins.t()), dim=-1).to(torch.bfloat16).contiguous()
        return CpuPacked(4, packed, scale_min, None, qw.group_size)

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.bfloat16

    def matmul(self, x: torch.Tensor, prepared: CpuPacked) -> torch.Tensor | None:
        if x.device.type != "cpu" or x.dim() != 2:
            return None
        # a fused draft passes bf16 rows already: no casts then (each is a dispatcher call)
        xb = x if x.dtype == torch.bfloat16 and x.is_contiguous() else x.to(torch.bfloat16).contiguous()
        if prepared.bits == 8:
            y = torch.ops.aten._weight_int8pack_mm(xb, prepared.weight, prepared.scales)
            y = y if y.dtype == x.dtype else y.to(x.dtype)
            if prepared.offset is not None:
                y = y + x.float().sum(-1, keepdim=True).to(x.dtype) * prepared.offset.to(x.dtype)
            return y
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, prepared.weight, prepared.group_size, prepared.scales)
        return y if y.dtype == x.dtype else y.to(x.dtype)


@dataclass(frozen=True)
class FbgemmPacked:
    """One weight prepacked for FBGEMM (its own copy: the int8 codes, or the fp16 dequantization)."""

    packed: torch.ScriptObject
    out_features: int
    in_features: int
    bytes_per_weight: int = 1

    @property
    def extra_nbytes(self) -> int:
        return self.bytes_per_weight * self.out_features * self.in_features


class _FbgemmKernel:
    """What FBGEMM's kernels share: 2-D rows on a CPU, fp32 compute, the result in the caller's dtype."""

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def matmul(self, x: torch.Tensor, prepared: FbgemmPacked) -> torch.Tensor | None:
        if x.device.type != "cpu" or x.dim() != 2:
            return None
        rows = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        y = self._product(rows, prepared.packed)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def _product(self, rows: torch.Tensor, packed: torch.ScriptObject) -> torch.Tensor:
        raise NotImplementedError


class FbgemmInt8(_FbgemmKernel):
    """FBGEMM's dynamic int8 GEMM as a ``WeightKernel`` (see the module docstring): symmetric
    per-channel int8 weights on a CPU; fp32 compute, the result in the caller's dtype."""

    def prepare(self, qw: QuantizedWeight) -> FbgemmPacked | None:
        if qw.bits != 8 or qw.n_groups != 1 or qw.zeros is not None or qw.qweight.device.type != "cpu" \
                or not int8_available():
            return None
        codes = (qw.qweight.to(torch.int16) - 128).to(torch.int8)
        scales = qw.scales[:, 0].double()
        with warnings.catch_warnings():  # torch 2.13 marks quantized tensors deprecated; the op still takes one
            warnings.simplefilter("ignore", UserWarning)
            quantized = torch._make_per_channel_quantized_tensor(codes, scales, torch.zeros_like(scales, dtype=torch.int64), 0)
        return FbgemmPacked(torch.ops.quantized.linear_prepack(quantized, None), qw.out_features, qw.in_features)

    def _product(self, rows: torch.Tensor, packed: torch.ScriptObject) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(rows, packed, True)


class FbgemmFp16(_FbgemmKernel):
    """FBGEMM's fp16 GEMM as a ``WeightKernel`` (see the module docstring): any quantized weight on
    a CPU, held as its fp16 dequantization; fp32 compute, the result in the caller's dtype."""

    def prepare(self, qw: QuantizedWeight) -> FbgemmPacked | None:
        if qw.qweight.device.type != "cpu" or not fp16_available():
            return None
        dense = dequantize_weight(qw, torch.float32)
        return FbgemmPacked(torch.ops.quantized.linear_prepack_fp16(dense, None), qw.out_features, qw.in_features, 2)

    def _product(self, rows: torch.Tensor, packed: torch.ScriptObject) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(rows, packed)
