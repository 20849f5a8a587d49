"""Tree attention for vLLM's CPU backend, registered over ``CPU_ATTN`` through vLLM's backend registry.

vLLM's native CPU kernel runs first (every request, causal); then the rows of this step's tree
requests are recomputed in torch: each node attends to its request's whole committed prefix and
to its own ancestors (the :class:`~dyntree.vllm_plugin.runner.TreeStep` masks), reading the paged
cache through :class:`~dyntree.vllm_plugin.kv_layout.PagedKV` (the tree tokens' own K/V were
written to their linear slots before the kernel ran). fp32 and bf16 caches, any CPU ISA layout.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from dyntree.vllm_plugin.kv_layout import PagedKV
from dyntree.vllm_plugin.runner import current_step

__all__ = ["TreeCPUAttentionBackend", "TreeCPUAttentionImpl"]


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
        paged = PagedKV.of(kv_cache, layer.isa)
        group = self.num_heads // self.num_kv_heads
        for b, (row, start, mask) in enumerate(zip(step.rows, step.starts, step.masks)):
            t, length = mask.shape
            keys, values = paged.gather(attn_metadata.block_table[row], torch.arange(length))
            q = query[start : start + t].float().transpose(0, 1)  # [Hq, T, D]
            k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
            v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
            scores = (q @ k.transpose(1, 2)) * self.scale
            scores.masked_fill_(~mask, float("-inf"))
            rows = torch.softmax(scores, dim=-1) @ v  # [Hq, T, D]
            out[start : start + t] = rows.transpose(0, 1).reshape(out[start : start + t].shape).to(out.dtype)
        return out


class TreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[TreeCPUAttentionImpl]:
        return TreeCPUAttentionImpl
