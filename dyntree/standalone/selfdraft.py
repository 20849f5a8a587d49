"""The quantized self-draft's forward over a Hugging Face model and its ``DynamicCache``: the
:class:`~dyntree.common.drafter.SelfDraftBackend` the standalone engine attaches to a ``qspec``
drafter.

The draft forward is the target's own decoder ``forward`` run on a shallow copy of the decoder
whose layer list is the draft's (:func:`~dyntree.common.drafters.qspec.build_draft_layers`), so
with quantization off it computes exactly what the target computes. Where a weight kernel serves
the quantized layers (torch's int8/int4 ops on CPU, the W4A16 Triton kernel on CUDA) and the
layers are Llama's, the same layers run fused instead (:mod:`dyntree.common.fused_draft`)
and the draft reads an int8 copy of the LM head. KV: the draft reads the engine's committed prefix KV (its cache rows, read-only)
and writes its draft tokens' KV into the free slots after that prefix in the engine's own cache
buffers, which the verify forward overwrites (:meth:`~dyntree.common.fused_draft.ScratchKV.lend`);
where the requests are not the cache's rows in order, a scratch cache for one step
(:class:`~dyntree.common.fused_draft.ScratchKV`: the prefix copied once per step while that fits
its budget, else concatenated per layer call, never a second full cache).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Sequence

import torch
from torch import nn

from dyntree.common.drafter import DraftRequest
from dyntree.common.drafters.qspec import build_draft_layers, kept_layers
from dyntree.common.fused_draft import (LM_HEAD_SPEC, ScratchKV, attention_mask, fuse_layers, hf_rope, norm_weight,
                                         rms_norm, run_layers)
from dyntree.common.quant import QSpec, QSpecError, QuantLinear
from dyntree.kernels.cpu_weight_only import cpu_weight_kernel
from dyntree.kernels.w4a16 import W4A16Kernel

if TYPE_CHECKING:
    from dyntree.standalone.engine import SpecEngine

__all__ = ["HFSelfDraft"]

class HFSelfDraft:
    """Draft layers over the engine's cache rows (see the module docstring).

    Args:
        engine: the standalone engine whose model and live cache the draft reads.
        spec: what to quantize.
        materialize: keep dequantized dense copies of the quantized weights (CPU acceptance
            measurements only: same numbers, faster, but the memory saving is gone); implies the
            HF layer path.
        fused: run the fused layers where they apply (``False``: always the HF layer path).
    """

    def __init__(self, engine: "SpecEngine", spec: QSpec, materialize: bool = False, fused: bool = True) -> None:
        model = engine.model
        decoder = model.get_decoder()
        layers = getattr(decoder, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise QSpecError(f"qspec: the target's decoder ({type(decoder).__name__}) has no .layers ModuleList")
        self.engine = engine
        self.spec = spec
        self.lm_head = model.get_output_embeddings()
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        kernel = (W4A16Kernel() if self.device.type == "cuda" and self.dtype in (torch.float16, torch.bfloat16)
                  else cpu_weight_kernel(self.device, spec.weight_bits or 8))
        kept = kept_layers(layers, spec)
        self.fused = fuse_layers(kept, decoder.config, spec, kernel) if fused and not materialize else None
        # the HF path: the target's forward code over quantized copies of the kept layers
        draft_layers = nn.ModuleList(kept) if self.fused is not None else build_draft_layers(layers, spec, kernel)
        self.decoder = copy.copy(decoder)
        self.decoder._modules = dict(decoder._modules)
        self.decoder.layers = draft_layers
        self.decoder.config = copy.copy(decoder.config)
        self.decoder.config.num_hidden_layers = len(draft_layers)
        if self.fused is not None:
            self._norm = norm_weight(decoder.norm.weight)  # the final norm, as the fused layers take it
            self.quant_layers = [m for f in self.fused for m in (f.qkv, f.o, f.gate_up, f.down)]
            head = QuantLinear.from_linear(self.lm_head, LM_HEAD_SPEC, kernel=kernel)
            if head.kernel is not None:  # the fast path reads an int8 copy of the LM head as well
                self.lm_head = head
                self.quant_layers.append(head)
            for m in self.quant_layers:  # every call goes through the kernel: its copy is enough
                m.release_codes()
        else:
            self.quant_layers = [m for m in draft_layers.modules() if isinstance(m, QuantLinear)]
        if materialize:
            for m in self.quant_layers:
                m.materialize(self.dtype)
        self.kernel_layers = sum(m.kernel is not None for m in self.quant_layers)
        self.target_bytes = _param_bytes(model)
        self.last_scratch_bytes = 0
        self.last_transient_bytes = 0
        self._rows: list[int] = []
        self._kv_lens = torch.zeros(0, dtype=torch.int64)
        self._kv = ScratchKV(len(draft_layers))

    @property
    def overhead_bytes(self) -> int:
        """Memory the draft adds to the target: its quantized weights (0 for ``none``)."""
        return sum(m.nbytes for m in self.quant_layers)

    def reset(self, requests: Sequence[DraftRequest]) -> None:
        rows = self.engine.cache_rows([r.request_id for r in requests])
        for r, row in zip(requests, rows):
            if self.engine.kv_len(row) != r.kv_len:
                raise ValueError(f"qspec: request {r.request_id!r} has kv_len={r.kv_len}, the engine's cache "
                                 f"row holds {self.engine.kv_len(row)}")
        self._rows = rows
        self._kv_lens = torch.tensor([r.kv_len for r in requests])
        self._kv = ScratchKV(len(self.decoder.layers))
        self._lend(max((r.kv_len for r in requests), default=0))

    def release(self) -> None:
        self._kv = ScratchKV(len(self.decoder.layers))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, scratch_mask: torch.Tensor) -> torch.Tensor:
        prefix_len = int(self._kv_lens.max()) if self._kv_lens.numel() else 0
        mask = attention_mask(self._kv_lens, prefix_len, scratch_mask, self.dtype)
        if self._kv.needs_prefix or self.fused is None:  # the HF path counts the prefix's length
            self._kv.prefix = self._prefix(prefix_len)
        try:
            with torch.inference_mode():
                tokens, positions = tokens.to(self.device), positions.to(self.device)
                mask = None if mask is None else mask.to(self.device)
                if self.fused is not None:
                    hidden = self.decoder.embed_tokens(tokens)
                    cos, sin = self.decoder.rotary_emb(hidden, positions)
                    hidden = rms_norm(run_layers(self.fused, hidden, hf_rope(cos, sin), mask, self._kv,
                                                 self.engine.attention), self._norm)
                else:
                    if mask is None:  # the decoder's own default would be causal
                        keys = self._kv.get_seq_length() + tokens.shape[1]
                        mask = torch.zeros(tokens.shape[0], 1, tokens.shape[1], keys, dtype=self.dtype,
                                           device=self.device)
                    hidden = self.decoder(input_ids=tokens, position_ids=positions, attention_mask=mask,
                                          past_key_values=self._kv, use_cache=True,
                                          **self.engine.attention_kwargs()).last_hidden_state
                logits = self.lm_head(hidden)
        finally:
            self._kv.prefix = [None] * len(self._kv.prefix)
        self.last_scratch_bytes = self._kv.scratch_bytes
        self.last_transient_bytes = self._kv.peak_transient_bytes
        return logits

    def _lend(self, prefix_len: int) -> None:
        """Let the draft write its tokens' KV into the free slots after each layer's committed
        prefix in the engine's own cache buffers (slots the verify forward overwrites), instead of
        copying the prefix once per step: when the requests are the cache's rows in order and
        every row is ``prefix_len`` long or padded to it."""
        if self._rows != list(range(len(self._rows))) or prefix_len == 0:
            return
        layers = getattr(self.engine.cache, "layers", [])
        for i in range(min(len(self.decoder.layers), len(layers))):
            layer = layers[i]
            store = getattr(layer, "store", None)
            if (store is not None and layer.keys.dim() == 4 and layer.keys.shape[0] == len(self._rows)
                    and layer.keys.shape[2] == prefix_len and store.holds(layer.keys, layer.values)):
                self._kv.lend(i, store, prefix_len)

    def _prefix(self, prefix_len: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per draft layer, the target's keys/values for the requests' rows, sliced to the
        longest prefix (views when the requests are the cache's rows in order)."""
        cache = self.engine.cache
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        layers = getattr(cache, "layers", [])
        for i in range(len(self.decoder.layers)):
            layer = layers[i] if i < len(layers) else None
            keys = getattr(layer, "keys", None)
            if prefix_len == 0 or keys is None or keys.numel() == 0:
                out.append(None)
                continue
            values = layer.values
            if self._rows != list(range(keys.shape[0])):
                idx = torch.tensor(self._rows, device=keys.device)
                keys, values = keys.index_select(0, idx), values.index_select(0, idx)
            out.append((keys[:, :, :prefix_len], values[:, :, :prefix_len]))
        return out


def _param_bytes(model: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for p in model.parameters():  # tied weights appear once
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total
