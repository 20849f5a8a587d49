"""The quantized self-draft inside SGLang: the draft forward over SGLang's token-pool KV cache.

The ``qspec`` drafter (engine-neutral, :mod:`dyntree.common.drafters.qspec`) drafts with a
:class:`~dyntree.common.drafter.SelfDraftBackend`; this is SGLang's. SGLang's Llama has the stacked
projections vLLM's has, so the draft layers are :class:`~dyntree.common.stacked_draft.StackedSelfDraft`'s
(the target's own weights quantized at load, on the CPU low-bit kernels or the W4A16 Triton kernel
on CUDA). Per speculation step it gathers each request's committed prefix KV out of the token pool
(``req_to_token[req_pool_index, :kv_len]`` slot ids -> ``k_buffer[layer_id]`` /
``v_buffer[layer_id]``, one index shared by every layer) and keeps the draft tokens' KV in a
plugin-side scratch area: SGLang's pool is only read.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from dyntree.common.drafter import DraftRequest
from dyntree.common.quant import QSpec, QSpecError, WeightKernel
from dyntree.common.stacked_draft import StackedSelfDraft

__all__ = ["SglangSelfDraft", "weight_kernel"]


def weight_kernel(device: torch.device, dtype: torch.dtype, bits: int = 8) -> WeightKernel:
    """The low-bit kernel for SGLang's model's ``bits``-bit weights on ``device`` (refuses where none exists)."""
    if device.type == "cpu":
        from dyntree.kernels.cpu_weight_only import cpu_weight_kernel

        kernel = cpu_weight_kernel(device, bits)
        if kernel is not None:
            return kernel
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        from dyntree.kernels.w4a16 import W4A16Kernel

        return W4A16Kernel()
    raise QSpecError(f"qspec inside SGLang: no low-bit kernel for a {dtype} model on {device.type} "
                     "(CPU with FBGEMM or torch's weight-only ops, or CUDA in float16/bfloat16)")


class SglangSelfDraft(StackedSelfDraft):
    """Draft layers over SGLang's token pool (see the module docstring).

    Args:
        model: SGLang's loaded Llama-family model.
        spec: what to quantize (weight-only).
        vocab: the real vocabulary.
        worker: the :class:`~dyntree.sglang_plugin.worker.DynTreeWorker`; its ``kv_pool`` and this
            step's decode ``batch`` (requests, ``req_pool_indices``, ``req_to_token``) are read.
    """

    def __init__(self, model: torch.nn.Module, spec: QSpec, vocab: int, worker: Any) -> None:
        weight = next(model.parameters())
        super().__init__(model, spec, vocab, weight_kernel(weight.device, weight.dtype, spec.weight_bits or 8), "SGLang")
        self.layer_ids = [int(layer.self_attn.attn.layer_id) for layer in self.kept]
        self.worker = worker

    def reset(self, requests: Sequence[DraftRequest]) -> None:
        """Gather each request's committed prefix KV (every draft layer) out of the token pool."""
        pool, batch = self.worker.kv_pool, self.worker.batch
        req_to_token = batch.req_to_token_pool.req_to_token
        rows = dict(zip((req.rid for req in batch.reqs), batch.req_pool_indices.tolist()))
        lengths = [r.kv_len for r in requests]
        longest = max(lengths, default=0)
        slots = torch.zeros(len(requests), longest, dtype=torch.int64, device=req_to_token.device)
        for b, (r, n) in enumerate(zip(requests, lengths)):
            slots[b, :n] = req_to_token[rows[r.request_id], :n]  # the rest stays slot 0 and is masked
        flat = slots.flatten()
        prefix = []
        for layer_id in self.layer_ids:
            k, v = pool.k_buffer[layer_id], pool.v_buffer[layer_id]  # [pool, kv_heads, head_dim]
            prefix.append(tuple(buf[flat].view(len(requests), longest, *buf.shape[1:]).transpose(1, 2).to(self.dtype)
                                for buf in (k, v)))
        self.set_prefix(prefix, lengths)  # type: ignore[arg-type]
