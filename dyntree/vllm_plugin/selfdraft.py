"""The quantized self-draft inside vLLM: the draft forward over vLLM's paged CPU KV cache.

The ``qspec`` drafter (engine-neutral, :mod:`dyntree.common.drafters.qspec`) drafts with a
:class:`~dyntree.common.drafter.SelfDraftBackend`; this is vLLM's. At load it quantizes the
target's own stacked projections (vLLM's ``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj``) of the kept layers on the CPU's weight kernel
(:func:`~dyntree.kernels.cpu_weight_only.cpu_weight_kernel`)
(:class:`~dyntree.common.stacked_draft.StackedSelfDraft`, shared with SGLang); vLLM's CPU weight
packing is read back by :func:`_dense`. Each request's committed prefix KV is read from the tree
attention builder's :class:`~dyntree.vllm_plugin.mirror.PrefixMirror` (a dense copy beside vLLM's
paged cache, topped up with the positions committed since the request last drafted or verified a
tree), not gathered element by element out of vLLM's cache at every step. A lone request drafts
straight into the free slots after its copy's prefix (no copy at all); a batch's prefixes are
copied once per step into one padded buffer with room for the draft tokens, which the draft then
writes into (:class:`~dyntree.common.fused_draft.ScratchKV`). vLLM's cache is only read.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

from dyntree.common.drafter import DraftRequest
from dyntree.common.kv_store import KVStore
from dyntree.common.quant import QSpec, QSpecError
from dyntree.common.stacked_draft import StackedSelfDraft
from dyntree.kernels.cpu_weight_only import cpu_weight_kernel
from dyntree.vllm_plugin.attention import TreeCPUAttentionMetadataBuilder
from dyntree.vllm_plugin.step import layer_caches, tree_builders

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
        kernel = cpu_weight_kernel(torch.device("cpu"), spec.weight_bits or 8)
        if kernel is None:
            raise QSpecError("qspec inside vLLM: this torch has no CPU weight kernel (FBGEMM or the weight-only ops)")
        super().__init__(model, spec, vocab, kernel, "vLLM", dense=_dense)
        self.layer_names = [layer.self_attn.attn.layer_name for layer in self.kept]
        self.proposer = proposer
        self._owners: list[tuple[str, TreeCPUAttentionMetadataBuilder]] | None = None  # per draft layer

    def reset(self, requests: Sequence[DraftRequest]) -> None:
        """Bring each request's mirror up to its committed prefix and hand the draft layers their
        prefix KV (module docstring)."""
        runner = self.proposer.runner
        if runner is None:
            raise RuntimeError("dyntree qspec: the model runner is not known yet (the runner patch did not run)")
        row_of = {rid: i for i, rid in enumerate(self.proposer.step.req_ids)}
        block_tables = runner.input_batch.block_table[0].block_table.cpu
        lengths = [r.kv_len for r in requests]
        room = max(r.max_nodes for r in requests) + 1  # the draft's slots, past which ScratchKV copies
        caches = layer_caches(runner)
        copies = {}  # per KV-cache group's builder: each request's mirror buffer
        for builder in self._builders(runner):
            layout, group = builder.layout, [caches[name] for name in builder.layers]
            copies[id(builder)] = [
                builder.mirror.sync(r.request_id, n, room, group,
                                    functools.partial(layout.span_index, block_tables[row_of[r.request_id]]))
                for r, n in zip(requests, lengths)]
        assert self._owners is not None
        stores = [self._store([copy[builder.layers[name]] for copy in copies[id(builder)]], lengths, room)
                  for name, builder in self._owners]
        self.set_prefix([(st.keys[:, :, : st.used], st.values[:, :, : st.used]) for st in stores], lengths)
        for i, store in enumerate(stores):
            self._kv.lend(i, store, store.used)

    def _builders(self, runner: Any) -> list[TreeCPUAttentionMetadataBuilder]:
        """The tree attention builders that hold the draft layers (:attr:`_owners`, found once)."""
        if self._owners is None:
            builders = [b for b in tree_builders(runner) if isinstance(b, TreeCPUAttentionMetadataBuilder)]
            owner = {name: b for b in builders for name in b.layers}
            missing = [name for name in self.layer_names if name not in owner]
            if missing:
                raise RuntimeError(f"dyntree qspec: no dyntree CPU tree attention builder holds layer {missing[0]!r} "
                                   "(the draft reads its prefix from that builder's mirror)")
            self._owners = [(name, owner[name]) for name in self.layer_names]
        return list({id(b): b for _, b in self._owners}.values())

    def _store(self, copies: list[torch.Tensor], lengths: list[int], room: int) -> KVStore:
        """One draft layer's prefix KV with room after it: a lone request's mirror buffer itself,
        else the requests' prefixes copied into one zero-padded ``[2, B, Hkv, L + room, D]``."""
        if len(copies) == 1 and copies[0].dtype == self.dtype:
            return KVStore(copies[0].unsqueeze(1), lengths[0])
        length = max(lengths)
        _, hkv, _, d = copies[0].shape
        buffer = torch.empty(2, len(copies), hkv, length + room, d, dtype=self.dtype)
        for b, (copy, n) in enumerate(zip(copies, lengths)):
            buffer[:, b, :, :n].copy_(copy[:, :, :n])
            buffer[:, b, :, n:length].zero_()  # masked, but never NaN
        return KVStore(buffer, length)
