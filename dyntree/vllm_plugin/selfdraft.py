"""The quantized self-draft inside vLLM: the draft forward over vLLM's paged CPU KV cache.

The ``qspec`` drafter (engine-neutral, :mod:`dyntree.common.drafters.qspec`) drafts with a
:class:`~dyntree.common.drafter.SelfDraftBackend`; this is vLLM's. At load it quantizes the
target's own stacked projections (vLLM's ``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj``) of the kept layers on the CPU low-bit kernels
(:class:`~dyntree.common.stacked_draft.StackedSelfDraft`, shared with SGLang); vLLM's CPU weight
packing is read back by :func:`_dense`. Per speculation step it gathers each request's
committed prefix KV out of the runner's paged cache (:class:`~dyntree.vllm_plugin.kv_layout.KVLayout`
indices, planned once per step and shared by every layer) and keeps the draft tokens' KV in a
plugin-side scratch area (:class:`~dyntree.common.fused_draft.ScratchKV`) that is dropped when
the step ends: vLLM's cache is only read.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from dyntree.common.drafter import DraftRequest
from dyntree.common.quant import QSpec, QSpecError
from dyntree.common.stacked_draft import StackedSelfDraft
from dyntree.kernels.cpu_weight_only import CpuWeightOnly
from dyntree.vllm_plugin.kv_layout import KVLayout

__all__ = ["VllmSelfDraft"]


def _dense(linear: Any) -> torch.Tensor:
    """A linear layer's ``[out, in]`` weight. vLLM's CPU backend packs weights for its GEMM at load
    and drops ``.weight``; the dense weight is then read back through that GEMM from identity
    rows (exact: every output is one weight times one), a chunk at a time."""
    w = linear.weight
    if w.numel() > 0:
        return w.detach()
    gemm = getattr(linear, "cpu_linear", None)
    size = getattr(linear, "input_size_per_partition", None)
    if gemm is None or size is None:
        raise QSpecError(f"qspec inside vLLM: {type(linear).__name__} holds no readable weight")
    rows = []
    with torch.inference_mode():
        for start in range(0, size, 1024):
            eye = torch.zeros(min(1024, size - start), size, dtype=w.dtype)
            eye[:, start : start + eye.shape[0]] = torch.eye(eye.shape[0], dtype=w.dtype)
            rows.append(gemm(eye, w, None))
    return torch.cat(rows).t().contiguous()


class VllmSelfDraft(StackedSelfDraft):
    """Draft layers over vLLM's paged KV (see the module docstring).

    Args:
        model: vLLM's loaded Llama-family model (``model.model.layers``, ``model.lm_head``).
        proposer: the worker's :class:`~dyntree.vllm_plugin.proposer.DynTreeProposer`; its
            ``runner`` (KV caches, block tables) and ``step.req_ids`` (batch order) are read each step.
        spec: what to quantize (weight-only).
        vocab: the real vocabulary (vLLM pads its LM head).
    """

    def __init__(self, model: torch.nn.Module, proposer: Any, spec: QSpec, vocab: int) -> None:
        if next(model.parameters()).device.type != "cpu":
            raise QSpecError("qspec inside vLLM runs on CPU workers only (its GPU path is the standalone engine's)")
        super().__init__(model, spec, vocab, CpuWeightOnly(), "vLLM", dense=_dense)
        self.layer_names = [layer.self_attn.attn.layer_name for layer in self.kept]
        self.proposer = proposer

    def reset(self, requests: Sequence[DraftRequest]) -> None:
        """Gather each request's committed prefix KV (every draft layer) out of vLLM's cache."""
        runner = self.proposer.runner
        if runner is None:
            raise RuntimeError("dyntree qspec: the model runner is not known yet (the runner patch did not run)")
        row_of = {rid: i for i, rid in enumerate(self.proposer.step.req_ids)}
        block_tables = runner.input_batch.block_table[0].block_table.cpu
        block_rows = [block_tables[row_of[r.request_id]] for r in requests]
        lengths = [r.kv_len for r in requests]
        context = runner.compilation_config.static_forward_context
        plans: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per cache layout, shared by its layers
        prefix = []
        for name in self.layer_names:
            layer = context[name]
            kv = layer.kv_cache[0] if isinstance(layer.kv_cache, (list, tuple)) else layer.kv_cache
            layout = KVLayout.of(kv, layer.isa)
            if id(layout) not in plans:
                plans[id(layout)] = layout.prefix_index(block_rows, lengths)
            prefix.append(tuple(layout.gather(kv, index, len(requests)).to(self.dtype)
                                for index in plans[id(layout)]))  # type: ignore[arg-type]
        self.set_prefix(prefix, lengths)
