"""The engine's KV cache (a Hugging Face ``DynamicCache`` that appends in place), the ragged
layout of a verify forward, and the ragged-batch surgery on the cache.

Layout: row ``b`` of every layer's ``[B, H, S, D]`` key/value tensors holds that request's
committed KV in slots ``[0, kv_len[b])``; slots beyond are garbage that the attention mask
hides. A verify forward runs the batch's trees back to back as one ``[1, N]`` sequence (each
request pays the linears for its own nodes only, not for the widest tree); within
:func:`ragged` (the forward's :class:`RaggedLayout` on its cache) the cache scatters the flat KV
to slots ``[S, S + T)`` of each node's row (``T``: the widest tree) and the engine's attention
(:mod:`dyntree.standalone.attention`, given the same layout) attends each row's queries over its
own cache row. Compaction then copies each row's accepted nodes to
``[kv_len[b], kv_len[b] + a_b)`` and the cache is cropped to the longest row.

Transformers' ``DynamicLayer`` appends by concatenation, which copies a layer's whole cache on
every forward (most of a decoding step at large batches: ``docs/measurements.md``). :class:`GrowingCache` keeps each layer's keys and values as
views into a buffer with headroom, so an append writes only the new tokens; the buffer is copied
only when it runs out of room (growing by a quarter) or when the surgery below replaced the
tensors (rows leaving or joining the batch).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from dyntree.common.kv_store import KVStore, append_kv

__all__ = ["GrowingCache", "GrowingLayer", "RaggedLayout", "ragged", "seq_len", "append_rows", "compact", "crop",
           "select_rows"]

#: Slots a buffer keeps free beyond what it holds when it is (re)allocated, at least.
HEADROOM = 128


@dataclass(frozen=True)
class RaggedLayout:
    """Where the flat tokens of a ragged forward sit in the batch: flat token ``i`` is node
    ``cols[i]`` of cache row ``rows[i]``; row ``b`` owns flat tokens ``starts[b] : starts[b] +
    sizes[b]``, its root first."""

    rows: torch.Tensor  # [N] int64
    cols: torch.Tensor  # [N] int64
    starts: list[int]
    sizes: list[int]

    @classmethod
    def from_indptr(cls, indptr: torch.Tensor) -> "RaggedLayout":
        """The layout of a :class:`~dyntree.common.tree.DraftBatch`'s ``qo_indptr``."""
        sizes = indptr.diff()
        rows = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
        return cls(rows, torch.arange(int(indptr[-1])) - indptr[:-1][rows], indptr[:-1].tolist(), sizes.tolist())

    @property
    def batch(self) -> int:
        return len(self.sizes)

    @property
    def width(self) -> int:
        """The widest row's tokens: the slots a forward appends to every cache row."""
        return max(self.sizes)

    @property
    def uniform(self) -> bool:
        """Every row has the same number of tokens (the flat sequence is the batch, row-major)."""
        return min(self.sizes) == self.width

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``[1, H, N, D]`` flat -> ``[B, H, T, D]`` per row (zeros where a row has fewer tokens)."""
        h, d = x.shape[1], x.shape[3]
        if self.uniform:
            return x[0].view(h, self.batch, self.width, d).transpose(0, 1)
        out = x.new_zeros(self.batch, h, self.width, d)
        out[self.rows.to(x.device), :, self.cols.to(x.device)] = x[0].transpose(0, 1)
        return out


@contextmanager
def ragged(cache: "GrowingCache", layout: RaggedLayout) -> Iterator[None]:
    """Within this block ``cache``'s forwards are ragged: it scatters the flat ``[1, H, N, D]`` KV
    it is given to its rows by ``layout`` (pass the same layout to the engine's attention)."""
    outer, cache.layout = cache.layout, layout
    try:
        yield
    finally:
        cache.layout = outer


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys`` / ``values`` are views of the first slots of a
    :class:`~dyntree.common.kv_store.KVStore`; :meth:`update` writes the new tokens into its free
    slots (the store grows by a quarter when they run out)."""

    store: KVStore | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.keys.shape[2] if self.keys.dim() == 4 else 0
        total = n + key_states.shape[2]
        self.keys, self.values, self.store = append_kv(self.keys if n else None, self.values if n else None,
                                                       key_states, value_states, self.store,
                                                       max(HEADROOM, total // 4))
        return self.keys, self.values


class GrowingCache(DynamicCache):
    """A ``DynamicCache`` of :class:`GrowingLayer` (one per decoder layer, created on first use);
    in a :func:`ragged` forward it scatters the flat new KV to its rows by :attr:`layout`."""

    def __init__(self) -> None:
        Cache.__init__(self, layer_class_to_replicate=GrowingLayer)
        self.layout: RaggedLayout | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layout is not None:
            key_states, value_states = self.layout.pad(key_states), self.layout.pad(value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def seq_len(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def compact(cache: DynamicCache, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """For every ``k``: copy slot ``src[k]`` of row ``rows[k]`` to slot ``dst[k]`` of that row.

    Sources are gathered before any write, so overlapping source and destination slots are safe.
    A layer whose keys and values are its store's newest cache moves both in one gather and one
    scatter of the store's buffer.
    """
    for layer in cache.layers:
        store = getattr(layer, "store", None)
        if store is not None and store.holds(layer.keys, layer.values):
            store.buffer[:, rows, :, dst] = store.buffer[:, rows, :, src]
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name)
            t[rows, :, dst] = t[rows, :, src]


def crop(cache: DynamicCache, length: int) -> None:
    """Drop every slot at or beyond ``length`` (a :class:`GrowingLayer`'s become free slots)."""
    for layer in cache.layers:
        store = getattr(layer, "store", None)
        if store is not None and store.holds(layer.keys, layer.values):
            layer.keys, layer.values = store.crop(length)
        else:
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
