"""vLLM's CPU paged KV cache, read and written element by element from torch.

vLLM's CPU attention stores each block's keys and values in an ISA-specific order (``vec``: keys
transposed per block; ``amx``: packed for the tile unit). Rather than hard-code those orders, the
plugin *probes* them once: it writes known values with vLLM's own
``cpu_attn_reshape_and_cache`` into a one-block scratch cache and records where every
``(offset, kv_head, dim)`` element landed. The result is a permutation; :class:`PagedKV` uses it
to gather a request's keys/values for tree attention and to move the accepted path's entries
(KV compaction). A layout that is not a permutation (a quantized cache) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = ["LayoutError", "block_permutation", "PagedKV"]


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


@dataclass
class PagedKV:
    """One layer's CPU KV cache ``[num_blocks, Hkv, block_size, 2 * D]`` and its block maps."""

    cache: torch.Tensor
    key_map: torch.Tensor
    value_map: torch.Tensor

    @classmethod
    def of(cls, kv_cache: torch.Tensor, isa: str) -> "PagedKV":
        if kv_cache.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise LayoutError(f"dyntree tree verification needs an unquantized KV cache, got {kv_cache.dtype}")
        _, hkv, block, two_d = kv_cache.shape
        key_map, value_map = block_permutation(isa, kv_cache.dtype, block, hkv, two_d // 2)
        return cls(kv_cache, key_map, value_map)

    @property
    def block_size(self) -> int:
        return self.cache.shape[2]

    def _index(self, block_row: torch.Tensor, positions: torch.Tensor, values: bool) -> tuple[torch.Tensor, ...]:
        """Advanced indices into the ``[num_blocks, Hkv, 2, block * D]`` view of the cache."""
        nb, hkv, block, two_d = self.cache.shape
        pos = positions.long()
        offs = pos % block
        flat = (self.value_map if values else self.key_map)[offs]  # [n, Hkv * D] within [Hkv, block * D]
        return block_row[pos // block].long()[:, None], flat // (block * two_d // 2), int(values), flat % (block * two_d // 2)

    def _view(self) -> torch.Tensor:
        nb, hkv, block, two_d = self.cache.shape
        return self.cache.view(nb, hkv, 2, block * two_d // 2)

    def gather(self, block_row: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[len(positions), Hkv, D]`` of a request's logical positions."""
        kv, hkv, d = self._view(), self.cache.shape[1], self.cache.shape[3] // 2
        keys = kv[self._index(block_row, positions, False)].reshape(-1, hkv, d)
        values = kv[self._index(block_row, positions, True)].reshape(-1, hkv, d)
        return keys, values

    def move(self, block_row: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy positions ``src`` to ``dst`` (all sources read before any write)."""
        keys, values = self.gather(block_row, src)
        kv = self._view()
        kv[self._index(block_row, dst, False)] = keys.reshape(len(dst), -1)
        kv[self._index(block_row, dst, True)] = values.reshape(len(dst), -1)
