"""vLLM's CPU paged KV cache, read and written element by element from torch.

vLLM's CPU attention stores each block's keys and values in an ISA-specific order (``vec``: keys
transposed per block; ``amx``: packed for the tile unit). Rather than hard-code those orders, the
plugin *probes* them once: it writes known values with vLLM's own
``cpu_attn_reshape_and_cache`` into a one-block scratch cache and records where every
``(offset, kv_head, dim)`` element landed. The result is a permutation; :class:`KVLayout` turns
it into linear indices that gather a request's keys/values for tree attention and move the
accepted path's entries (KV compaction). A layout that is not a permutation (a quantized cache) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = ["LayoutError", "block_permutation", "KVLayout"]


class LayoutError(RuntimeError):
    """The CPU KV layout could not be mapped (the message says why)."""


@lru_cache(maxsize=None)
def block_permutation(isa: str, dtype: torch.dtype, block_size: int, num_kv_heads: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key_map, value_map)``: int64 ``[block_size, num_kv_heads * head_size]``; entry ``[t, h * D
    + d]`` is where element ``d`` of KV head ``h`` at in-block offset ``t`` sits in one block's
    flattened key (value) area."""
    from vllm import _custom_ops as ops

    n = block_size * num_kv_heads * head_size
    base = 100  # every digit below 100 is exact in fp16/bf16/fp32
    digits = 1
    while base**digits < n:
        digits += 1
    idx = torch.arange(n).reshape(block_size, num_kv_heads, head_size)
    found = [torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)]
    for k in range(digits):
        cache = torch.full((1, num_kv_heads, 2 * block_size, head_size), -1.0, dtype=dtype)
        key_cache, value_cache = cache.chunk(2, dim=2)
        src = ((idx // base**k) % base).to(dtype)
        ops.cpu_attn_reshape_and_cache(src, src, key_cache, value_cache, torch.arange(block_size), isa)
        for f, area in zip(found, (key_cache, value_cache)):
            flat = area.reshape(-1).float()
            if bool((flat < 0).any()) or flat.numel() != n:
                raise LayoutError(f"vLLM CPU KV layout (isa={isa}, {dtype}) is not a permutation of a block's elements")
            f += flat.round().long() * base**k
    maps = []
    for f in found:
        if not torch.equal(torch.sort(f).values, torch.arange(n)):
            raise LayoutError(f"vLLM CPU KV layout (isa={isa}, {dtype}) is not a permutation of a block's elements")
        where = torch.empty(n, dtype=torch.int64)
        where[f] = torch.arange(n)  # element f[p] sits at position p
        maps.append(where.reshape(block_size, num_kv_heads * head_size))
    return maps[0], maps[1]


@dataclass(frozen=True)
class KVLayout:
    """Where each logical position's keys and values sit in one layer's flattened CPU cache
    ``[num_blocks, Hkv, block_size, 2 * D]`` (every layer of a model shares it). Indices are
    computed once per step on the host and reused by every layer (FlashInfer style)."""

    key_offsets: torch.Tensor  # [block_size, Hkv * D]: linear offsets inside one block
    value_offsets: torch.Tensor
    block_stride: int  # elements per block
    num_kv_heads: int
    head_size: int

    @classmethod
    def for_spec(cls, isa: str, dtype: torch.dtype, block_size: int, num_kv_heads: int, head_size: int) -> "KVLayout":
        """The layout of a cache vLLM allocates with these attributes (no cache tensor needed)."""
        return _layout(isa, dtype, block_size, num_kv_heads, head_size)

    def index(self, block_row: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Linear indices ``[len(positions), Hkv * D]`` of the keys and of the values of a
        request's logical positions, into ``cache.view(-1)``."""
        block = self.key_offsets.shape[0]
        pos = positions.long()
        base = (block_row[pos // block].long() * self.block_stride)[:, None]
        return base + self.key_offsets[pos % block], base + self.value_offsets[pos % block]

    def span_index(self, block_row: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Flat indices ``[2 * (end - start) * Hkv * D]`` of a request's positions ``start .. end
        - 1``: their keys', then their values' (what
        :meth:`~dyntree.vllm_plugin.mirror.PrefixMirror.copy_in` reads)."""
        keys, values = self.index(block_row, torch.arange(start, end))
        return torch.cat([keys.reshape(-1), values.reshape(-1)])


@lru_cache(maxsize=None)
def _layout(isa: str, dtype: torch.dtype, block: int, hkv: int, d: int) -> KVLayout:
    key_map, value_map = block_permutation(isa, dtype, block, hkv, d)
    area = block * d  # the [Hkv, 2, block * D] view of a block: head-major, keys then values

    def linear(where: torch.Tensor, values: int) -> torch.Tensor:
        return (where // area) * (2 * area) + values * area + where % area

    return KVLayout(linear(key_map, 0), linear(value_map, 1), hkv * block * 2 * d, hkv, d)
