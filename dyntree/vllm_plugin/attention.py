"""Tree attention for vLLM's CPU backend, registered over ``CPU_ATTN`` through vLLM's backend registry.

vLLM's native CPU kernel runs first (every request, causal); then the rows of this step's tree
requests are recomputed: each node attends to its request's whole committed prefix and to its own
ancestors (the :class:`~dyntree.vllm_plugin.runner.TreeStep` masks), reading the paged cache
through :class:`~dyntree.vllm_plugin.kv_layout.KVLayout` (the tree tokens' own K/V were written to
their linear slots before the kernel ran). The gather indices, query rows and padded masks are
planned once per step on the host (:func:`plan_tree_attention`); each layer then runs one gather
and one batched ``scaled_dot_product_attention`` over all tree requests. The time this adds to the
forward is summed in the step (``derived["tree_ms"]``) for the adaptive controller. fp32 and bf16
caches, any CPU ISA layout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from dyntree.vllm_plugin.kv_layout import KVLayout
from dyntree.vllm_plugin.runner import TreeStep, current_step

__all__ = ["TreeAttentionPlan", "plan_tree_attention", "TreeCPUAttentionBackend", "TreeCPUAttentionImpl"]


@dataclass(frozen=True)
class TreeAttentionPlan:
    """One step's tree attention, padded over its ``B`` tree requests (same for every layer)."""

    key_index: torch.Tensor  # [B * L * Hkv * D] linear cache indices (padding: 0, masked out)
    value_index: torch.Tensor
    rows: torch.Tensor  # [R] query rows of the tree nodes
    slots: torch.Tensor  # [R] their places in the padded [B * T] query
    bias: torch.Tensor  # [B, 1, T, L] additive mask: 0 where a (padded) node may attend, -inf elsewhere
    shape: tuple[int, int, int]  # (B, T, L)


def plan_tree_attention(step: TreeStep, layout: KVLayout, block_table: torch.Tensor,
                        dtype: torch.dtype) -> TreeAttentionPlan:
    """Gather indices, query rows and masks (``dtype``) of ``step``'s trees over ``layout`` (host only)."""
    b = len(step.rows)
    t = max(m.shape[0] for m in step.masks)
    length = max(m.shape[1] for m in step.masks)
    key_index, value_index = layout.prefix_index([block_table[row].cpu() for row in step.rows],
                                                 [m.shape[1] for m in step.masks])
    mask = torch.zeros(b, 1, t, length, dtype=torch.bool)
    mask[:, :, :, 0] = True  # padded query rows see one slot (no NaN); their output is dropped
    rows, slots = [], []
    for i, (start, m) in enumerate(zip(step.starts, step.masks)):
        n, ln = m.shape
        mask[i, 0, :n] = False
        mask[i, 0, :n, :ln] = m
        rows.append(torch.arange(start, start + n))
        slots.append(torch.arange(i * t, i * t + n))
    bias = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
    return TreeAttentionPlan(key_index, value_index, torch.cat(rows), torch.cat(slots), bias, (b, t, length))


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, with tree requests' rows recomputed under the ancestor mask."""

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        step = current_step()
        if step is None or attn_metadata is None or kv_cache.numel() == 0:
            return out
        if self.logits_soft_cap or self.sinks is not None or self.alibi_slopes is not None or self.sliding_window != -1:
            raise RuntimeError("dyntree tree attention does not support logit soft-capping, attention sinks, ALiBi "
                               "or sliding windows (this model uses one); drop method 'dyntree'")
        started = time.perf_counter()
        layout = KVLayout.of(kv_cache, layer.isa)
        plan = step.derived.get(("attention", id(layout)))
        if plan is None:
            plan = plan_tree_attention(step, layout, attn_metadata.block_table, query.dtype)
            step.derived[("attention", id(layout))] = plan
        b, t, _ = plan.shape
        k, v = layout.gather(kv_cache, plan.key_index, b), layout.gather(kv_cache, plan.value_index, b)
        q = query.new_zeros(b * t, *query.shape[1:])
        q[plan.slots] = query[plan.rows]
        q = q.view(b, t, self.num_heads, layout.head_size).transpose(1, 2).to(k.dtype)
        res = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.bias, scale=self.scale,
                                             enable_gqa=self.num_heads != layout.num_kv_heads)  # [B, Hq, T, D]
        res = res.transpose(1, 2).reshape(b * t, -1)[plan.slots]
        out[plan.rows] = res.reshape(out[plan.rows].shape).to(out.dtype)
        step.derived["tree_ms"] = step.derived.get("tree_ms", 0.0) + (time.perf_counter() - started) * 1e3
        return out


class TreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[TreeCPUAttentionImpl]:
        return TreeCPUAttentionImpl
