"""A dense copy of tree requests' committed KV, beside vLLM's paged CPU cache.

A tree node attends to its request's whole committed prefix. Reading that prefix out of vLLM's
paged, ISA-specific cache layout in every layer of every step would copy the prefix each time;
:class:`PrefixMirror` keeps, per request, one dense buffer ``[layers, 2, Hkv, capacity, D]``
(keys then values, head-major) holding positions ``0 .. synced - 1`` and copies in only what was
committed since (the tree attention plan says which positions; each layer copies its own).
Committed positions never change in vLLM's cache (a recomputed request starts again from an empty
mirror: the runner hooks call :meth:`release`), so the copy stays exact. Positions from
``synced`` on are scratch: a step writes its tree nodes' K/V there, and once the tree is verified
:meth:`commit` moves the accepted ones into place as vLLM's cache compaction does, so a request
whose steps keep drafting branching trees copies nothing out of vLLM's cache after its first.

The tree attention plan copies lazily, layer by layer inside the forward (:meth:`reserve`, then
:meth:`copy_in` per layer); the quantized self-draft, which drafts between forwards, brings a
request up to date in every layer at once (:meth:`sync`) and reads its prefix from the same copy,
so a request that both drafts with the self-draft and verifies trees is copied out of vLLM's
cache once.

Memory: ``2 * layers * Hkv * D`` elements per token of each live request that verified a
branching tree or drafted with the self-draft, grown by doubling, freed when the request ends.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["PrefixMirror"]


class PrefixMirror:
    """Per-request dense KV copies of one KV-cache group (see the module docstring)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> None:
        self.shape = (num_layers, 2, num_kv_heads, head_size)
        self.dtype = dtype
        self._buffers: dict[str, torch.Tensor] = {}
        self._synced: dict[str, int] = {}

    def reserve(self, request_id: str, prefix: int, length: int) -> int:
        """Make room for ``length`` positions of ``request_id`` and mark ``0 .. prefix - 1`` as
        synced once this step's layers have run; returns how many were synced before (the layers
        copy ``synced .. prefix - 1`` in). A shorter prefix than before (never in vLLM) is refused."""
        synced = self._synced.get(request_id, 0)
        if prefix < synced:
            raise RuntimeError(f"dyntree: request {request_id!r} prefix shrank from {synced} to {prefix} without a release")
        buf = self._buffers.get(request_id)
        if buf is None or buf.shape[3] < length:
            layers, two, hkv, d = self.shape
            capacity = max(length, 2 * (buf.shape[3] if buf is not None else 0), 64)
            grown = torch.empty(layers, two, hkv, capacity, d, dtype=self.dtype)
            if buf is not None:
                grown[:, :, :, :synced].copy_(buf[:, :, :, :synced])
            self._buffers[request_id] = grown
        self._synced[request_id] = prefix
        return synced

    def copy_in(self, request_id: str, layer: int, kv_cache: torch.Tensor, start: int, end: int,
                index: torch.Tensor) -> None:
        """Copy positions ``start .. end - 1`` of one layer out of its paged ``kv_cache``:
        ``index`` holds their keys' then their values' flat indices into ``kv_cache.view(-1)``
        (:meth:`~dyntree.vllm_plugin.kv_layout.KVLayout.span_index`)."""
        hkv, d = self.shape[2], self.shape[3]
        new = kv_cache.view(-1).index_select(0, index).view(2, end - start, hkv, d)
        self._buffers[request_id][layer, :, :, start:end].copy_(new.transpose(1, 2))

    def sync(self, request_id: str, length: int, room: int, caches: Sequence[torch.Tensor],
             index: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
        """Bring the request's copy up to its first ``length`` committed positions now, in every
        layer (``caches``: the group's paged caches in mirror order; ``index(start, end)``: the
        flat indices :meth:`copy_in` reads), with room for ``room`` more positions after them;
        returns its buffer ``[layers, 2, Hkv, capacity, D]``."""
        synced = self.reserve(request_id, length, length + room)
        if synced < length:
            flat = index(synced, length)
            for layer, kv_cache in enumerate(caches):
                self.copy_in(request_id, layer, kv_cache, synced, length, flat)
        return self._buffers[request_id]

    def commit(self, request_id: str, prefix: int, nodes: list[int]) -> None:
        """This step's tree (its nodes' K/V written at ``prefix ..`` by every layer) was verified
        and ``nodes`` (tree indices, root first) accepted: they become positions ``prefix .. prefix
        + len(nodes) - 1``, moved as vLLM's compaction moves them in its cache, and the mirror is
        synced up to there."""
        if self._synced.get(request_id) != prefix:
            raise RuntimeError(f"dyntree: request {request_id!r} committed a tree at {prefix}, but the mirror was "
                               f"planned at {self._synced.get(request_id)}")
        if nodes != list(range(len(nodes))):  # a path off the leading chain: every layer's nodes move at once
            buf = self._buffers[request_id]
            buf[:, :, :, prefix : prefix + len(nodes)] = buf[:, :, :, [prefix + n for n in nodes]]
        self._synced[request_id] = prefix + len(nodes)

    def buffer(self, request_id: str) -> torch.Tensor:
        """``[layers, 2, Hkv, capacity, D]``: the request's keys and values by position."""
        return self._buffers[request_id]

    def release(self, request_id: str) -> None:
        """Forget the request (it ended, or vLLM recomputes it from the start)."""
        self._buffers.pop(request_id, None)
        self._synced.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._buffers)
