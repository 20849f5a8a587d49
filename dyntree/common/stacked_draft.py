"""The quantized self-draft over a serving engine's Llama model (vLLM's and SGLang's layer layout).

vLLM and SGLang load Llama with the same module names: per decoder layer ``self_attn.qkv_proj``,
``self_attn.o_proj``, ``mlp.gate_up_proj``, ``mlp.down_proj`` (projections already stacked),
RMSNorms with ``weight`` / ``variance_epsilon``, and a rotary module whose ``cos_sin_cache
[max_position, head_dim]`` holds the cos half then the sin half (neox style). :class:`StackedSelfDraft`
quantizes the kept layers' projections into :mod:`~dyntree.common.fused_draft` layers plus an int8
copy of the LM head (embeddings, norms and the RoPE table are the target's own tensors, shared) and
runs the draft forward of the :class:`~dyntree.common.drafter.SelfDraftBackend` protocol.

What differs between engines is where the committed prefix KV lives: an engine subclass implements
``reset(requests)``, gathers every draft layer's prefix keys/values of the step's requests out of its
own cache (read-only) and hands them over with :meth:`StackedSelfDraft.set_prefix`; draft tokens'
KV lives in a :class:`~dyntree.common.fused_draft.ScratchKV` for one speculation step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Sequence

import torch
from torch.nn import functional as F

from dyntree.common.drafter import DraftRequest
from dyntree.common.drafters.qspec import kept_layers
from dyntree.common.fused_draft import LM_HEAD_SPEC, FusedLayer, ScratchKV, attention_mask, fused_layer, hf_rope, run_layers
from dyntree.common.quant import QSpec, QSpecError, QuantLinear, WeightKernel

__all__ = ["StackedSelfDraft", "DenseWeight"]

#: Reads a loaded linear layer's dense ``[out, in]`` weight (engines that repack weights override it).
DenseWeight = Callable[[Any], torch.Tensor]


def _plain_weight(linear: Any) -> torch.Tensor:
    return linear.weight.detach()


class StackedSelfDraft(ABC):
    """Fused quantized draft layers over an engine's stacked-projection Llama (module docstring).

    Args:
        model: the engine's loaded model (``model.model.layers``, ``model.model.embed_tokens``,
            ``model.model.norm``, ``model.lm_head``).
        spec: what to quantize (weight-only).
        vocab: the real vocabulary (engines pad their LM head).
        kernel: the low-bit kernel every quantized projection runs on.
        engine: the engine's name, in error messages.
        dense: reads a linear layer's dense weight.
    """

    def __init__(self, model: torch.nn.Module, spec: QSpec, vocab: int, kernel: WeightKernel, engine: str,
                 dense: DenseWeight = _plain_weight) -> None:
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if layers is None or getattr(model, "lm_head", None) is None:
            raise QSpecError(f"qspec inside {engine} drafts with a Llama-family model; {type(model).__name__} has no "
                             "model.layers / lm_head")
        if spec.act_bits is not None or not spec.quantized:
            raise QSpecError(f"qspec inside {engine} runs weight-only quantized drafts (w8a16 or w4a16), not {spec}")
        self.engine = engine
        self.kept = kept_layers(layers, spec)
        self.layers = [self._fuse(layer, i, spec, kernel, dense) for i, layer in enumerate(self.kept)]
        rope = self.kept[0].self_attn.rotary_emb
        if not getattr(rope, "is_neox_style", False) or int(rope.rotary_dim) != int(rope.head_size):
            raise QSpecError(f"qspec inside {engine} needs full-width neox-style RoPE (Llama's)")
        self.rope = rope  # its cos_sin_cache [max_position, head_dim]: cos half, then sin half (read per
        # forward: SGLang moves it to the model's device at the target's first forward)
        self.embed = inner.embed_tokens.weight
        self.norm = (inner.norm.weight, float(inner.norm.variance_epsilon))
        self.head = QuantLinear.from_weight(dense(model.lm_head), None, LM_HEAD_SPEC, kernel=kernel)
        if self.head.kernel is None:
            raise QSpecError(f"qspec inside {engine}: no low-bit kernel serves the int8 LM head on this device")
        self.quant_layers = [m for f in self.layers for m in (f.qkv, f.o, f.gate_up, f.down)] + [self.head]
        for m in self.quant_layers:  # every call goes through the kernel: its packed copy is enough
            m.release_codes()
        self.vocab = vocab
        self.dtype = self.embed.dtype
        self._kv = ScratchKV(len(self.layers))
        self._prefix: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._kv_lens = torch.zeros(0, dtype=torch.int64)

    def _fuse(self, layer: Any, index: int, spec: QSpec, kernel: WeightKernel, dense: DenseWeight) -> FusedLayer:
        """One decoder layer as a fused draft layer (refuses any other shape, naming it)."""
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        need = [(attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj"),
                (layer, "input_layernorm"), (layer, "post_attention_layernorm"), (attn, "rotary_emb")]
        missing = [name for owner, name in need if getattr(owner, name, None) is None]
        if missing:
            raise QSpecError(f"qspec inside {self.engine} drafts with Llama decoder layers; layer {index} "
                             f"({type(layer).__name__}) lacks {', '.join(missing)}")
        window = getattr(attn.attn, "sliding_window", None) or getattr(attn.attn, "sliding_window_size", -1)
        if (window is not None and window > 0) or getattr(attn, "q_norm", None) is not None:
            raise QSpecError(f"qspec inside {self.engine}: layer {index} uses a sliding window or q/k norms, which the "
                             "draft does not run")
        norms = [n.weight for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        weights = [(dense(p), getattr(p, "bias", None)) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        fused = fused_layer(norms[0], weights[0], weights[1], norms[1], weights[2], weights[3], int(attn.num_heads),
                            int(attn.num_kv_heads), int(attn.head_dim), float(attn.scaling), spec, kernel)
        if fused is None:
            raise QSpecError(f"qspec inside {self.engine}: no low-bit kernel serves layer {index}'s weights as {spec} on "
                             "this device (CPU: w8a16,perchannel or w4a16 with a group size that divides the hidden "
                             "size; CUDA: w4a16 in 16-bit)")
        return fused

    @property
    def overhead_bytes(self) -> int:
        """Memory the draft adds to the target: its quantized weights (packed by the kernel)."""
        return sum(m.nbytes for m in self.quant_layers)

    @abstractmethod
    def reset(self, requests: Sequence[DraftRequest]) -> None:
        """Gather the requests' committed prefix KV out of the engine's cache; call :meth:`set_prefix`."""

    def set_prefix(self, prefix: list[tuple[torch.Tensor, torch.Tensor]], kv_lens: Sequence[int]) -> None:
        """This step's committed prefix KV: per draft layer ``[B, kv_heads, L, head_dim]`` keys and
        values (``L`` = the longest of ``kv_lens``; rows past a request's length are masked)."""
        self._prefix = prefix
        self._kv_lens = torch.tensor(list(kv_lens), dtype=torch.int64)
        self._kv = ScratchKV(len(self.layers))

    def release(self) -> None:
        self._kv = ScratchKV(len(self.layers))
        self._prefix = []

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, scratch_mask: torch.Tensor) -> torch.Tensor:
        device = self.embed.device
        length = int(self._kv_lens.max()) if self._kv_lens.numel() else 0
        mask = attention_mask(self._kv_lens, length, scratch_mask, self.dtype)
        mask = None if mask is None else mask.to(device)
        tokens, positions = tokens.to(device), positions.to(device)
        table = self.rope.cos_sin_cache
        cos, sin = table[positions.to(table.device)].to(device=device, dtype=self.dtype).chunk(2, dim=-1)
        self._kv.prefix = list(self._prefix) if length else [None] * len(self.layers)
        try:
            with torch.inference_mode():
                hidden = F.embedding(tokens, self.embed)
                hidden = run_layers(self.layers, hidden, hf_rope(torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)),
                                    mask, self._kv)
                hidden = F.rms_norm(hidden, hidden.shape[-1:], *self.norm)
                return self.head(hidden)[..., : self.vocab]
        finally:
            self._kv.prefix = [None] * len(self.layers)
