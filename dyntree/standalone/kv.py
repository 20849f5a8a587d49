"""Ragged-batch KV-cache surgery on a Hugging Face ``DynamicCache``.

Layout: row ``b`` of every layer's ``[B, H, S, D]`` key/value tensors holds that request's
committed KV in slots ``[0, kv_len[b])``; slots beyond are garbage that the attention mask
hides. A verify forward appends the tree's KV at slots ``[S, S + T)`` for all rows; compaction
then copies each row's accepted nodes to ``[kv_len[b], kv_len[b] + a_b)`` and the cache is cropped
to the longest row.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

__all__ = ["seq_len", "append_rows", "compact", "crop", "select_rows"]


def seq_len(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def compact(cache: DynamicCache, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """For every ``k``: copy slot ``src[k]`` of row ``rows[k]`` to slot ``dst[k]`` of that row.

    Sources are gathered before any write, so overlapping source and destination slots are safe.
    """
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name)
            t[rows, :, dst] = t[rows, :, src]


def crop(cache: DynamicCache, length: int) -> None:
    """Drop every slot at or beyond ``length``."""
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]


def select_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep only the batch rows ``rows`` (finished requests leave the batch)."""
    for layer in cache.layers:
        layer.keys = layer.keys[rows]
        layer.values = layer.values[rows]


def append_rows(cache: DynamicCache, new: DynamicCache) -> None:
    """Append ``new``'s rows after ``cache``'s (requests joining the batch); the shorter side is
    padded with zero slots, which every row's mask hides (they lie beyond its ``kv_len``)."""
    for layer, add in zip(cache.layers, new.layers, strict=True):
        for name in ("keys", "values"):
            a, b = getattr(layer, name), getattr(add, name)
            s = max(a.shape[2], b.shape[2])
            pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, s - t.shape[2]))  # noqa: E731
            setattr(layer, name, torch.cat([pad(a), pad(b)], dim=0))
