"""The quantized weight format the low-bit kernels read: :class:`QuantizedWeight` (uint8 codes,
4-bit ones packed two to a byte, low nibble first; per-group scales and optional zero points) and
its exact reference reconstruction :func:`dequantize_weight`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["QuantizedWeight", "pack_int4", "unpack_int4", "dequantize_weight"]


@dataclass(frozen=True)
class QuantizedWeight:
    """A quantized ``[N, K]`` weight in the storage format described in the module docstring.

    Attributes:
        qweight: ``uint8`` codes, ``[N, K]`` (8 bit) or ``[N, ceil(K/2)]`` (4 bit, packed).
        scales: ``[N, n_groups]`` per-group scales.
        zeros: ``[N, n_groups]`` per-group zero points (integral values) or ``None`` (symmetric).
        bits: 4 or 8.
        group_size: the group length along ``K`` (``K`` itself for per-channel).
        in_features: ``K``.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group_size: int
    in_features: int

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def n_groups(self) -> int:
        return self.scales.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes held by codes, scales and zero points."""
        tensors = [self.qweight, self.scales] + ([self.zeros] if self.zeros is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack ``uint8`` codes in 0..15 of shape ``[N, K]`` into ``[N, ceil(K/2)]`` bytes
    (element ``2j`` in the low nibble). An odd ``K`` is padded with a zero nibble."""
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        raise ValueError(f"pack_int4: codes must be a 2-D uint8 tensor, got {codes.dtype} {tuple(codes.shape)}")
    if bool((codes > 15).any()):
        raise ValueError("pack_int4: codes must lie in 0..15")
    if codes.shape[1] % 2:
        codes = F.pad(codes, (0, 1))
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``[N, ceil(k/2)]`` bytes -> ``[N, k]`` codes."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"unpack_int4: packed must be a 2-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    if packed.shape[1] != (k + 1) // 2:
        raise ValueError(f"unpack_int4: packed has {packed.shape[1]} columns, expected ceil({k}/2)")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)[:, :k]


def dequantize_weight(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reconstruct the ``[N, K]`` weight in ``dtype`` (arithmetic in fp32)."""
    k = qw.in_features
    codes = unpack_int4(qw.qweight, k) if qw.bits == 4 else qw.qweight
    scale = qw.scales.float().repeat_interleave(qw.group_size, dim=1)[:, :k]
    if qw.zeros is None:
        w = (codes.float() - 2 ** (qw.bits - 1)) * scale
    else:
        w = (codes.float() - qw.zeros.float().repeat_interleave(qw.group_size, dim=1)[:, :k]) * scale
    return w.to(dtype)
