"""Tree attention as a vLLM CPU attention backend, registered over ``CPU_ATTN``.

vLLM's pattern: :class:`TreeCPUAttentionMetadataBuilder` plans once per step on host metadata and
:class:`TreeCPUAttentionImpl.forward` runs per layer on plain tensors. The runner hooks
(:mod:`dyntree.vllm_plugin.runner`) hand the builder the step's
:class:`~dyntree.vllm_plugin.step.TreeStep` (:meth:`~TreeCPUAttentionMetadataBuilder.plan_trees`)
before vLLM builds the step's attention metadata; the plan then reaches every layer inside that
metadata (:class:`TreeCPUAttentionMetadata`), through vLLM's forward context.

Each query row is computed once:

* rows without a tree go through vLLM's own CPU kernel, and so do chains (a tree without branches,
  whose nodes see exactly what causal attention shows them) and a branching tree's leading chain
  (:attr:`~dyntree.common.tree.DraftTree.lead_chain`: the root, its first child, and so on while
  each node's parent is the row before it, as a depth-first tree starts);
* a branching tree's other rows, which that kernel also computes but with nodes that are not their
  ancestors in view, are overwritten here by one attention call over the request's committed
  prefix and its in-step nodes, each node seeing the prefix and its own ancestors: the form of
  :func:`~dyntree.kernels.cpu_attention.attend` that this CPU runs fastest at that shape (timed once
  per machine and head shape, as the standalone engine's, :func:`tree_attention_dispatch`);
* a step whose every query row is a branching tree's (batch 1 with a tree) does not run vLLM's
  kernel at all: each tree's rows, leading chain included, are computed here only, so the
  prefix's KV is read once per layer, not twice.

The prefix is read from a :class:`~dyntree.vllm_plugin.mirror.PrefixMirror`: a dense copy of each
tree request's committed KV that the plan brings up to date with the positions it lacks (read from
vLLM's paged cache through the probed :class:`~dyntree.vllm_plugin.kv_layout.KVLayout`), so a layer
copies only the tokens committed since the request's last tree, not its whole prefix.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from dyntree import progress
from dyntree.kernels import cpu_attention
from dyntree.kernels.cpu_attention import AttentionDispatch, attend
from dyntree.models import cache_root
from dyntree.vllm_plugin.kv_layout import KVLayout
from dyntree.vllm_plugin.mirror import PrefixMirror
from dyntree.vllm_plugin.step import Move, TreeStep, ablations, refuse_attention_features

__all__ = ["TreeRows", "TreeAttentionPlan", "plan_tree_rows", "tree_rows_attention", "tree_attention_dispatch",
           "TreeCPUAttentionMetadata", "TreeCPUAttentionMetadataBuilder", "TreeCPUAttentionImpl",
           "TreeCPUAttentionBackend"]


@dataclass(frozen=True)
class TreeRows:
    """One tree request's part of a step (host metadata, shared by every layer).

    Attributes:
        request_id: vLLM's request id (the mirror's key).
        start: its first query row (the root) in the step's flat query.
        size: its tree's nodes, root included (``T``).
        first: the first node computed here (the tree's leading chain, served by vLLM's kernel,
            comes before it).
        prefix: committed tokens before the root (``P``): the KV every node sees.
        synced: the mirror's length before this step; positions ``synced .. P - 1`` are copied in.
        sync_index: ``[2 * (P - synced) * Hkv * D]`` flat indices of their keys then values in a
            layer's paged cache (empty: nothing to copy).
        bias: ``[1, 1, T - first, P + T]`` additive mask in the cache dtype of the nodes computed
            here: 0 where a node may attend (the prefix, itself and its ancestors), ``-inf`` elsewhere.
    """

    request_id: str
    start: int
    size: int
    first: int
    prefix: int
    synced: int
    sync_index: torch.Tensor
    bias: torch.Tensor


@dataclass
class TreeAttentionPlan:
    """A step's tree rows for one KV-cache group, and the time its layers spent on them."""

    requests: list[TreeRows]
    layers: dict[str, int]  # layer name -> index in the mirror
    mirror: PrefixMirror
    dispatch: AttentionDispatch | None = None  # the attention form per shape (None: fused GQA)
    spent_ms: float = 0.0  # summed over layers, mirror fill included
    whole: bool = False  # its requests' rows are every query row of the step: vLLM's kernel is skipped


@dataclass
class TreeCPUAttentionMetadata(CPUAttentionMetadata):
    """vLLM's CPU attention metadata plus the step's tree plan (``None``: no tree this step)."""

    tree: TreeAttentionPlan | None = None


class TreeCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata builder that also plans the step's trees (see the module docstring).

    It owns the group's :class:`PrefixMirror`; the runner hooks call :meth:`plan_trees` before
    each step's :meth:`build`, :meth:`compact` and :meth:`commit` after verification and
    :meth:`release` when a request ends or is recomputed (the
    :class:`~dyntree.vllm_plugin.step.TreeAttentionBuilder` contract)."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.layers = {name: i for i, name in enumerate(layer_names)}
        self.mirror = PrefixMirror(len(layer_names), self.num_kv_heads, self.head_dim, self.dtype)
        self.dispatch = tree_attention_dispatch(self.num_heads, self.num_kv_heads, self.head_dim, self.dtype)
        self._pending: TreeStep | None = None

    @property
    def layout(self) -> KVLayout:
        """Where positions sit in each of its layers' paged caches (probed once per cache shape)."""
        return KVLayout.for_spec(self.isa, self.dtype, self.block_size, self.num_kv_heads, self.head_dim)

    def plan_trees(self, step: TreeStep | None) -> None:
        """The trees of the step whose metadata :meth:`build` builds next."""
        self._pending = step

    def release(self, request_id: str) -> None:
        self.mirror.release(request_id)

    def compact(self, kv_caches: Mapping[str, torch.Tensor], block_table: Any, moves: list[Move]) -> None:
        """Move the accepted nodes' KV in every layer of the group: indices over the probed
        :class:`KVLayout` computed once, then one gather and one scatter per layer."""
        if not moves:
            return
        rows, layout = block_table.block_table.cpu, self.layout
        src, dst = [], []
        for m in moves:
            src.extend(layout.index(rows[m.row], m.prefix + m.nodes))
            dst.extend(layout.index(rows[m.row], m.prefix + torch.arange(len(m.nodes))))
        src_index, dst_index = torch.cat(src).reshape(-1), torch.cat(dst).reshape(-1)
        for name in self.layers:
            flat = kv_caches[name].view(-1)
            flat[dst_index] = flat[src_index]  # every source is read before any write

    def commit(self, step: TreeStep) -> None:
        """The mirror keeps the accepted nodes of the trees this builder planned (:meth:`PrefixMirror.commit`)."""
        assert step.accept is not None
        index = {rid: b for b, rid in enumerate(step.batch.request_ids)}
        for plan in step.attention:
            if plan.mirror is self.mirror:
                for r in plan.requests:
                    self.mirror.commit(r.request_id, r.prefix, step.accept.accepted(index[r.request_id]))

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> TreeCPUAttentionMetadata:
        step, self._pending = self._pending, None
        branching = step.branching if step is not None else []
        plan = None
        if step is not None and branching:
            layout = self.layout
            # every query row is a branching tree's: computed here, vLLM's kernel not run at all
            whole = sum(step.batch.trees[b].size for b in branching) == common_attn_metadata.num_actual_tokens
            plan = plan_tree_rows(step, branching, layout, self.mirror, self.layers,
                                  common_attn_metadata.block_table_tensor, self.dtype, self.dispatch,
                                  whole)
            step.attention.append(plan)
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        return TreeCPUAttentionMetadata(**{f.name: getattr(meta, f.name) for f in fields(meta)}, tree=plan)


def tree_attention_dispatch(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> AttentionDispatch:
    """The attention form per (query rows, cached tokens) of one tree request's call on this CPU:
    the three forms timed once per machine, torch, thread count, dtype and head shape (cached on
    disk beside the standalone engine's timings)."""
    return cpu_attention.calibrate(heads, kv_heads, head_dim, dtype, cache_dir=cache_root() / "attention",
                                   grid=((1,), cpu_attention.GRID_QUERY, cpu_attention.GRID_KV),
                                   announce=progress.step)


def plan_tree_rows(step: TreeStep, branching: list[int], layout: KVLayout, mirror: PrefixMirror,
                   layers: dict[str, int], block_table: torch.Tensor, dtype: torch.dtype,
                   dispatch: AttentionDispatch | None = None, whole: bool = False) -> TreeAttentionPlan:
    """The rows of ``step``'s trees ``branching`` (indices into its batch) for every layer of one
    KV-cache group (host only): mirror room and sync indices over ``layout``, masks in ``dtype``,
    each request's attention by ``dispatch`` (fused GQA without one). ``whole``: they are every
    query row of the step, so each tree's leading chain is computed here too (vLLM's kernel
    does not run), else from after it."""
    requests = []
    # the ``lead`` ablation (a test control) leaves a whole step's leading chains uncomputed
    whole_rows = whole and "lead" not in ablations()
    for b in branching:
        rid, row, start, prefix, mask = (step.batch.request_ids[b], step.rows[b], step.starts[b], step.prefix[b],
                                         step.masks[b])
        size, first = mask.shape[0], 0 if whole_rows else step.batch.trees[b].lead_chain
        synced = mirror.reserve(rid, prefix, prefix + size)
        if synced < prefix:
            sync_index = layout.span_index(block_table[row].cpu(), synced, prefix)
        else:
            sync_index = torch.empty(0, dtype=torch.int64)
        bias = torch.zeros(1, 1, size - first, prefix + size, dtype=dtype)
        bias[0, 0, :, prefix:].masked_fill_(~mask[first:], float("-inf"))
        requests.append(TreeRows(rid, start, size, first, prefix, synced, sync_index, bias))
    return TreeAttentionPlan(requests, layers, mirror, dispatch, whole=whole)


def tree_rows_attention(plan: TreeAttentionPlan, layer_name: str, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, scale: float) -> None:
    """One layer's tree rows into ``out`` (``query [N, Hq, D]``, this step's ``key``/``value``
    ``[N, Hkv, D]``, the layer's paged ``kv_cache``): the mirror takes the positions it lacks and
    the step's nodes, then one attention per tree request over its prefix and nodes."""
    index = plan.layers.get(layer_name)
    if index is None:
        raise RuntimeError(f"dyntree: layer {layer_name!r} is not in the tree plan's KV-cache group")
    for r in plan.requests:
        if r.sync_index.numel():
            plan.mirror.copy_in(r.request_id, index, kv_cache, r.synced, r.prefix, r.sync_index)
        buf = plan.mirror.buffer(r.request_id)[index]  # [2, Hkv, capacity, D]
        nodes, end = slice(r.start, r.start + r.size), r.prefix + r.size
        buf[0, :, r.prefix : end].copy_(key[nodes].transpose(0, 1))  # the step's nodes, no stacked temporary
        buf[1, :, r.prefix : end].copy_(value[nodes].transpose(0, 1))
        kv = buf[:, :, :end].unsqueeze(1)  # [2, 1, Hkv, P + T, D]
        if plan.whole and r.first:  # the ``lead`` control: rows nobody computes are zero
            out[r.start : r.start + r.first] = 0
        rows = slice(r.start + r.first, r.start + r.size)
        res = attend(query[rows].transpose(0, 1).unsqueeze(0), kv[0], kv[1], r.bias, scale, plan.dispatch)  # [1, Hq, T', D]
        out[rows].view(res.shape[2], res.shape[1], res.shape[3]).copy_(res[0].transpose(0, 1))  # one strided copy


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention; branching trees' rows past their leading chain are then computed under
    their ancestor masks (in a step of branching trees only, every row is, and vLLM's kernel does
    not run)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        refuse_attention_features(self.logits_soft_cap, self.sinks, self.alibi_slopes, self.sliding_window != -1)

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        plan = getattr(attn_metadata, "tree", None)
        if plan is None or not plan.whole:
            out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
            if plan is None:
                return out
        else:
            out = output
        started = time.perf_counter()
        tree_rows_attention(plan, layer.layer_name, query, key, value, kv_cache, out, self.scale)
        plan.spent_ms += (time.perf_counter() - started) * 1e3
        return out


class TreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[TreeCPUAttentionImpl]:
        return TreeCPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TreeCPUAttentionMetadataBuilder]:
        return TreeCPUAttentionMetadataBuilder
