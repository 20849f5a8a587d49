"""W4A16 matmul: 16-bit activations times group-wise int4 weights, dequantized in registers.

``w4a16_matmul(x, packed, scales, zeros, group_size)`` computes ``x @ deq(W)^T`` for
``x [M, K]`` (fp16 / bf16; fp32 for interpreter tests) and a weight stored as in
:mod:`dyntree.kernels.quant_format` (codes packed two per byte along ``K``: ``packed [N, ceil(K/2)]``,
``scales`` / ``zeros`` ``[N, ceil(K / group_size)]``, ``zeros is None`` = symmetric with implicit
zero point 8). It is built for the draft's small-``M`` shapes (1..64 tokens), where the matmul is
bound by reading the weight: int4 reads a quarter of the bytes of bf16.

Kernel layout: a program owns a ``BLOCK_M x BLOCK_N`` output tile and one of ``SPLIT_K`` slices
of ``K``. Per ``BLOCK_K`` step it loads ``BLOCK_K / 2`` bytes per output row, splits low (even
``k``) and high (odd ``k``) nibbles, dequantizes each half with the group's scale (``BLOCK_K``
divides ``group_size``, so one scale per row per step) and does two ``tl.dot`` with the even and
odd columns of ``x``; fp32 accumulation. With ``SPLIT_K > 1`` slices add into an fp32 output with
atomics (summation order, hence the last fp32 bits, may vary from run to run).

:func:`w4a16_matmul_reference` is the readable torch definition (dequantize, then matmul in
fp32). This module imports without Triton; the kernel then raises a clear error. On a machine
without a GPU, Triton runs only under ``TRITON_INTERPRET=1`` (tests, small shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dyntree.kernels.quant_format import QuantizedWeight, dequantize_weight
from dyntree.kernels._triton import HAS_TRITON, interpreting, tl, triton

__all__ = ["HAS_TRITON", "W4A16Config", "W4A16Kernel", "w4a16_matmul", "w4a16_matmul_reference", "kernel_supports",
           "default_config"]

_BLOCK_KS = (128, 64, 32)


@dataclass(frozen=True)
class W4A16Config:
    """Launch parameters (``block_k`` must divide the group size unless one group spans K)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def kernel_supports(k: int, group_size: int) -> bool:
    """Whether the kernel handles this ``K`` / group size (a multiple of 32, or one group)."""
    return k > 0 and group_size > 0 and (group_size >= k or group_size % 32 == 0)


def default_config(m: int, n: int, k: int, group_size: int, sm_count: int = 1) -> W4A16Config:
    """A heuristic launch: the widest ``block_k`` that fits the group, and enough ``K`` splits
    that the grid has about two programs per SM (``sm_count=1``: no split)."""
    if not kernel_supports(k, group_size):
        raise ValueError(f"w4a16: group_size must be a multiple of 32 or >= K={k}, got {group_size}")
    block_k = 128 if group_size >= k else next(b for b in _BLOCK_KS if group_size % b == 0)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64
    tiles = _cdiv(m, block_m) * _cdiv(n, block_n)
    k_blocks = _cdiv(k, block_k)
    split = 1
    while split < 16 and tiles * split < 2 * sm_count and split * 2 <= k_blocks:
        split *= 2
    return W4A16Config(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_inputs(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int
) -> tuple[int, int, int]:
    if x.dim() != 2:
        raise ValueError(f"w4a16: x must be 2-D [M, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != (k + 1) // 2:
        raise ValueError(
            f"w4a16: packed must be uint8 [N, ceil(K/2)] = [N, {(k + 1) // 2}] for K={k}, "
            f"got {packed.dtype} {tuple(packed.shape)}"
        )
    n = packed.shape[0]
    if group_size <= 0:
        raise ValueError(f"w4a16: group_size must be positive, got {group_size}")
    n_groups = _cdiv(k, group_size)
    if scales.shape != (n, n_groups):
        raise ValueError(f"w4a16: scales must be [N, ceil(K/group)] = [{n}, {n_groups}], got {tuple(scales.shape)}")
    if zeros is not None and zeros.shape != scales.shape:
        raise ValueError(f"w4a16: zeros must match scales {tuple(scales.shape)}, got {tuple(zeros.shape)}")
    for name, t in (("packed", packed), ("scales", scales), ("zeros", zeros)):
        if t is not None and t.device != x.device:
            raise ValueError(f"w4a16: {name} is on {t.device}, x on {x.device}")
    return m, n, k


def w4a16_matmul_reference(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    """Torch definition: ``(x.float() @ dequantize(W).T).to(x.dtype)``, ``[M, N]``."""
    _, _, k = _check_inputs(x, packed, scales, zeros, group_size)
    w = dequantize_weight(QuantizedWeight(packed, scales, zeros, 4, group_size, k), torch.float32)
    return (x.float() @ w.t()).to(x.dtype)


def w4a16_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    config: W4A16Config | None = None,
) -> torch.Tensor:
    """Triton W4A16 matmul, ``[M, N]`` in ``x.dtype``; see the module docstring for layouts."""
    if not HAS_TRITON:
        raise RuntimeError("w4a16_matmul needs triton (pip install triton); use w4a16_matmul_reference")
    m, n, k = _check_inputs(x, packed, scales, zeros, group_size)
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"w4a16: x must be fp16, bf16 or fp32, got {x.dtype}")
    in_interpreter = interpreting()
    if not x.is_cuda and not in_interpreter:
        raise RuntimeError("w4a16_matmul needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tests)")
    if config is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
        config = default_config(m, n, k, group_size, sms)
    if not (group_size >= k or group_size % config.block_k == 0) or config.block_k % 32:
        raise ValueError(f"w4a16: block_k={config.block_k} must be a multiple of 32 dividing group_size={group_size}")
    k_blocks = _cdiv(k, config.block_k)
    split = max(1, min(config.split_k, k_blocks))
    k_per_split = _cdiv(k_blocks, split) * config.block_k
    split = _cdiv(k, k_per_split)
    y = torch.zeros(m, n, device=x.device, dtype=torch.float32)
    scales = scales.contiguous()
    z = zeros.contiguous() if zeros is not None else scales  # same strides as scales; unread if None
    grid = (_cdiv(m, config.block_m), _cdiv(n, config.block_n), split)
    _w4a16_kernel[grid](
        x, packed, scales, z, y,
        m, n, k, k_per_split,
        x.stride(0), x.stride(1), packed.stride(0), packed.stride(1), scales.stride(0), scales.stride(1),
        y.stride(0), y.stride(1),
        GROUP=group_size,
        HAS_ZEROS=zeros is not None,
        ATOMIC=split > 1,
        # bf16 tl.dot is broken in the interpreter; fp32 inputs get exact (ieee) dots
        DOT_FP32=x.dtype == torch.float32 or (in_interpreter and x.dtype == torch.bfloat16),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return y.to(x.dtype)


@dataclass(frozen=True)
class _Prepared:
    """The weight as stored (the kernel reads the common format directly: nothing extra)."""

    qw: QuantizedWeight
    extra_nbytes: int = 0


class W4A16Kernel:
    """The :class:`~dyntree.common.quant.WeightKernel` an engine hands to ``QuantLinear`` on a
    GPU: int4 weights of a supported group size; calls with CUDA 16-bit activations."""

    def prepare(self, qw: QuantizedWeight) -> _Prepared | None:
        if not HAS_TRITON or qw.bits != 4 or not kernel_supports(qw.in_features, qw.group_size):
            return None
        return _Prepared(qw)

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def matmul(self, x: torch.Tensor, prepared: _Prepared) -> torch.Tensor | None:
        if not (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)):
            return None
        qw = prepared.qw
        return w4a16_matmul(x, qw.qweight, qw.scales, qw.zeros, qw.group_size)


if HAS_TRITON:

    @triton.jit
    def _w4a16_kernel(
        x_ptr, w_ptr, s_ptr, z_ptr, y_ptr,
        M, N, K, K_PER_SPLIT,
        stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg, stride_ym, stride_yn,
        GROUP: tl.constexpr,
        HAS_ZEROS: tl.constexpr,
        ATOMIC: tl.constexpr,
        DOT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_j = tl.arange(0, BLOCK_K // 2)
        m_mask = offs_m < M
        n_mask = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_begin = pid_k * K_PER_SPLIT
        k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
        for k0 in range(k_begin, k_end, BLOCK_K):
            k_even = k0 + 2 * offs_j  # the K index of each byte's low nibble
            x_rows = x_ptr + offs_m[:, None] * stride_xm
            x_even = tl.load(x_rows + k_even[None, :] * stride_xk, mask=m_mask[:, None] & (k_even[None, :] < K), other=0.0)
            x_odd = tl.load(
                x_rows + (k_even[None, :] + 1) * stride_xk, mask=m_mask[:, None] & (k_even[None, :] + 1 < K), other=0.0
            )
            w_bytes = tl.load(
                w_ptr + offs_n[:, None] * stride_wn + (k0 // 2 + offs_j)[None, :] * stride_wk,
                mask=n_mask[:, None] & (k_even[None, :] < K),
                other=0,
            )
            group = k0 // GROUP
            scale = tl.load(s_ptr + offs_n * stride_sn + group * stride_sg, mask=n_mask, other=0.0).to(tl.float32)
            lo = (w_bytes & 0xF).to(tl.float32)
            hi = (w_bytes >> 4).to(tl.float32)
            if HAS_ZEROS:
                zero = tl.load(z_ptr + offs_n * stride_sn + group * stride_sg, mask=n_mask, other=0.0).to(tl.float32)
                w_even = (lo - zero[:, None]) * scale[:, None]
                w_odd = (hi - zero[:, None]) * scale[:, None]
            else:
                w_even = (lo - 8.0) * scale[:, None]
                w_odd = (hi - 8.0) * scale[:, None]
            if DOT_FP32:
                acc += tl.dot(x_even.to(tl.float32), tl.trans(w_even), input_precision="ieee")
                acc += tl.dot(x_odd.to(tl.float32), tl.trans(w_odd), input_precision="ieee")
            else:
                acc += tl.dot(x_even, tl.trans(w_even.to(x_even.dtype)))
                acc += tl.dot(x_odd, tl.trans(w_odd.to(x_odd.dtype)))
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
        y_mask = m_mask[:, None] & n_mask[None, :]
        if ATOMIC:
            tl.atomic_add(y_ptrs, acc, mask=y_mask)
        else:
            tl.store(y_ptrs, acc, mask=y_mask)
