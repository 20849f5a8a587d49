"""Packed ancestor masks: the tree-visibility format the tree-attention kernels read.

Row ``i`` of a tree's mask marks the nodes node ``i`` may attend to (itself and its ancestors),
packed 32 to an int32 word.
"""

from __future__ import annotations

import torch

__all__ = ["WORD_BITS", "pack_ancestor_bits", "unpack_ancestor_bits"]

#: Bits per word of a packed ancestor mask.
WORD_BITS = 32


def pack_ancestor_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack ``[B, T, T]`` bool ancestor masks into ``[B, T, ceil(T/32)]`` int32 words.

    Bit ``j % 32`` of word ``j // 32`` in row ``i`` is set iff ``mask[b, i, j]`` (node ``j`` is
    ``i`` or an ancestor of ``i``; :class:`TreeBatch` padding rows hold only their own bit). Words
    are two's-complement int32, so bit 31 makes a word negative.
    """
    if mask.dim() != 3 or mask.shape[1] != mask.shape[2]:
        raise ValueError(f"mask must have shape [B, T, T], got {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool, got {mask.dtype}")
    b, t, _ = mask.shape
    words = (t + WORD_BITS - 1) // WORD_BITS
    padded = torch.zeros(b, t, words * WORD_BITS, dtype=torch.int64, device=mask.device)
    padded[..., :t] = mask.to(torch.int64)
    weights = torch.ones(WORD_BITS, dtype=torch.int64, device=mask.device) << torch.arange(
        WORD_BITS, device=mask.device
    )
    packed = (padded.view(b, t, words, WORD_BITS) * weights).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def unpack_ancestor_bits(bits: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Inverse of :func:`pack_ancestor_bits`: ``[B, T, W]`` int32 -> ``[B, T, num_nodes]`` bool."""
    if bits.dim() != 3 or bits.dtype != torch.int32:
        raise ValueError(f"bits must be [B, T, W] int32, got {tuple(bits.shape)} {bits.dtype}")
    if num_nodes > bits.shape[2] * WORD_BITS:
        raise ValueError(f"num_nodes={num_nodes} exceeds {bits.shape[2]} words of {WORD_BITS} bits")
    shifts = torch.arange(WORD_BITS, dtype=torch.int32, device=bits.device)
    unpacked = (bits.unsqueeze(-1) >> shifts) & 1
    return unpacked.flatten(-2)[..., :num_nodes].bool()
