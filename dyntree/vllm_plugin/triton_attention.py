"""Tree attention as a vLLM GPU attention backend, registered over ``TRITON_ATTN`` (CUDA).

The CPU backend's pattern (:mod:`dyntree.vllm_plugin.attention`) on vLLM's GPU paged cache:
:class:`TreeTritonAttentionMetadataBuilder` plans once per step on host metadata and ships the plan
to the device in two copies (no host sync); :class:`TreeTritonAttentionImpl.forward` runs per layer
on plain tensors:

* every row goes through vLLM's own Triton kernel (``unified_attention``); a branching tree's rows
  go there with a sequence length equal to their query length (a few-token causal pass over the
  first blocks whose output is overwritten: the prefix is not read twice);
* the branching trees' rows are then computed in one
  :func:`~dyntree.kernels.dispatch.tree_attention_vllm` call over vLLM's cache (the
  :mod:`dyntree.kernels` paged tree-attention kernel: each KV block is read once per KV head for all
  nodes and query heads of a request, long prefixes split along the KV axis), each node seeing the
  request's committed prefix and its own ancestors (:class:`TreeTritonPlan`), and written into the
  layer's output rows.

Chains and requests without a tree stay with vLLM's kernel as they are. KV compaction runs the
:func:`~dyntree.kernels.dispatch.kv_compact_vllm` kernel per layer (:meth:`~TreeTritonAttentionMetadataBuilder.compact`).
vLLM's Triton cache is ``[num_blocks, Hkv, block_size, 2 * D]`` in logical order (keys then values in
the last dimension), whatever its stride order; the kernels take its K and V halves as views.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, Mapping

import torch
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)

from dyntree.kernels._triton import Backend
from dyntree.kernels.ancestor_bits import pack_ancestor_bits
from dyntree.kernels.dispatch import kv_compact_vllm, tree_attention_vllm
from dyntree.vllm_plugin.step import Move, TreeStep, refuse_attention_features

__all__ = ["TreeTritonPlan", "plan_tree_batch", "without_tree_prefix", "tree_rows_triton", "compact_triton", "TreeTritonAttentionMetadata",
           "TreeTritonAttentionMetadataBuilder", "TreeTritonAttentionImpl", "TreeTritonAttentionBackend"]


@dataclass(frozen=True)
class TreeTritonPlan:
    """A step's branching trees for the paged tree-attention kernel (device tensors, shared by every
    layer; tree ``b`` is batch row ``block_table_rows[b]``).

    Attributes:
        rows: ``[N]`` int64, the trees' query rows in the step's flat query, tree by tree.
        query_start_loc: ``[B + 1]`` int32, tree ``b``'s rows are ``rows[qsl[b]:qsl[b + 1]]``.
        seq_lens: ``[B]`` int32, prefix plus tree size (the tree's K/V is in the cache at the last
            positions, written by vLLM before attention runs).
        block_table_rows: ``[B]`` int32, each tree's row of vLLM's block table.
        tree_bits: ``[B, T_max, W]`` int32 packed ancestor masks
            (:func:`~dyntree.kernels.ancestor_bits.pack_ancestor_bits`).
        max_seq_len: the longest ``seq_lens`` (host: sizes the kernel's KV split without a sync).
        backend: ``auto`` (Triton on CUDA, the torch reference elsewhere); tests force ``triton``.
    """

    rows: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table_rows: torch.Tensor
    tree_bits: torch.Tensor
    max_seq_len: int
    backend: Backend = "auto"


def plan_tree_batch(step: TreeStep, branching: list[int], device: torch.device, backend: Backend = "auto") -> TreeTritonPlan:
    """The plan of ``step``'s trees ``branching`` (indices into its batch): built on the host, moved
    to ``device`` in one int64 and one int32 copy."""
    sizes = [step.masks[b].shape[0] for b in branching]
    rows = torch.cat([torch.arange(step.starts[b], step.starts[b] + n) for b, n in zip(branching, sizes)])
    seq_lens = [step.prefix[b] + n for b, n in zip(branching, sizes)]
    qsl = [0]
    for n in sizes:
        qsl.append(qsl[-1] + n)
    meta = torch.tensor(qsl + seq_lens + [step.rows[b] for b in branching], dtype=torch.int32)
    nb = len(branching)
    masks = torch.zeros(nb, max(sizes), max(sizes), dtype=torch.bool)
    for i, (b, n) in enumerate(zip(branching, sizes)):
        masks[i, :n, :n] = step.masks[b]
    bits = pack_ancestor_bits(masks)
    rows, meta, bits = (t.to(device, non_blocking=True) for t in (rows, meta, bits))
    return TreeTritonPlan(rows, meta[: nb + 1], meta[nb + 1 : 2 * nb + 1], meta[2 * nb + 1 :], bits, max(seq_lens),
                          backend)


def without_tree_prefix(seq_lens: torch.Tensor, plan: TreeTritonPlan) -> torch.Tensor:
    """A copy of vLLM's per-request ``seq_lens`` (device) in which each of ``plan``'s tree requests
    is only its tree: vLLM's kernel then reads no prefix for rows whose output the tree kernel
    replaces (device ops on the plan's tensors: no host work, no copy)."""
    qsl = plan.query_start_loc
    out = seq_lens.clone()
    out[plan.block_table_rows.long()] = (qsl[1:] - qsl[:-1]).to(out.dtype)
    return out


def tree_rows_triton(plan: TreeTritonPlan, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     out: torch.Tensor, scale: float) -> None:
    """One layer's tree rows into ``out`` (``query`` ``[N, Hq, D]``, ``out`` its shape or ``[N, Hq *
    D]``, the layer's vLLM cache and block table): one kernel over every tree's prefix and nodes."""
    q = query.index_select(0, plan.rows)
    res = tree_attention_vllm(q, kv_cache, block_table, plan.seq_lens, plan.query_start_loc, plan.tree_bits, scale,
                              block_table_rows=plan.block_table_rows, max_seq_len=plan.max_seq_len,
                              backend=plan.backend)
    out.view(out.shape[0], -1).index_copy_(0, plan.rows, res.reshape(res.shape[0], -1).to(out.dtype))


def compact_triton(kv_caches: list[torch.Tensor], block_table: torch.Tensor, moves: list[Move],
                   backend: Backend = "auto") -> None:
    """Apply ``moves`` to each layer's vLLM GPU cache (``block_table`` on the caches' device): the
    moves packed once, then one :func:`~dyntree.kernels.dispatch.kv_compact_vllm` launch per layer."""
    if not moves or not kv_caches:
        return
    width = max(len(m.nodes) for m in moves)
    index = torch.zeros(len(moves), width, dtype=torch.int32)
    for i, m in enumerate(moves):
        index[i, : len(m.nodes)] = m.nodes
    meta = torch.tensor([[m.prefix for m in moves], [len(m.nodes) for m in moves], [m.row for m in moves]],
                        dtype=torch.int32)
    device = kv_caches[0].device
    index, meta = index.to(device, non_blocking=True), meta.to(device, non_blocking=True)
    for kv in kv_caches:
        kv_compact_vllm(kv, block_table, meta[0], index, meta[1], block_table_rows=meta[2], backend=backend)


@dataclass
class TreeTritonAttentionMetadata(TritonAttentionMetadata):
    """vLLM's Triton attention metadata plus the step's tree plan (``None``: no branching tree)."""

    tree: TreeTritonPlan | None = None


class TreeTritonAttentionMetadataBuilder(TritonAttentionMetadataBuilder):
    """vLLM's Triton metadata builder that also plans the step's trees (see the module docstring);
    the :class:`~dyntree.vllm_plugin.step.TreeAttentionBuilder` contract of the runner hooks. A full
    CUDA graph would replay attention without the tree pass, so it declares none (vLLM then keeps
    attention out of its graphs; the plugin also asks for eager mode)."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.layers = {name: i for i, name in enumerate(layer_names)}
        self._pending: TreeStep | None = None

    def plan_trees(self, step: TreeStep | None) -> None:
        self._pending = step

    def release(self, request_id: str) -> None:
        """Nothing is kept per request: every step reads the prefix from vLLM's cache."""

    def compact(self, kv_caches: Mapping[str, torch.Tensor], block_table: Any, moves: list[Move]) -> None:
        compact_triton([kv_caches[name] for name in self.layers], block_table.block_table.gpu, moves)

    def commit(self, step: TreeStep) -> None:
        """Nothing is kept beside vLLM's cache."""

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> TreeTritonAttentionMetadata:
        step, self._pending = self._pending, None
        branching = step.branching if step is not None else []
        plan = None
        if step is not None and branching:
            plan = plan_tree_batch(step, branching, self.device)
            seq_lens = without_tree_prefix(common_attn_metadata.seq_lens, plan)
            common_attn_metadata = replace(common_attn_metadata, seq_lens=seq_lens)
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        return TreeTritonAttentionMetadata(**{f.name: getattr(meta, f.name) for f in fields(meta)}, tree=plan)


class TreeTritonAttentionImpl(TritonAttentionImpl):
    """vLLM's Triton attention; branching trees' rows are then computed under their ancestor masks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        refuse_attention_features(self.logits_soft_cap, self.sinks, self.alibi_slopes,
                                  tuple(self.sliding_window) != (-1, -1))

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        plan = getattr(attn_metadata, "tree", None)
        if plan is not None:
            tree_rows_triton(plan, query, kv_cache, attn_metadata.block_table, out, self.scale)
        return out


class TreeTritonAttentionBackend(TritonAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[TreeTritonAttentionImpl]:
        return TreeTritonAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TreeTritonAttentionMetadataBuilder]:
        return TreeTritonAttentionMetadataBuilder
