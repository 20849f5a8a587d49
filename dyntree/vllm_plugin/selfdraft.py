"""The quantized self-draft inside vLLM: the draft forward over vLLM's paged CPU KV cache.

The ``qspec`` drafter (engine-neutral, :mod:`dyntree.common.drafters.qspec`) drafts with a
:class:`~dyntree.common.drafter.SelfDraftBackend`; this is vLLM's. At load it quantizes the
target's own stacked projections (vLLM's ``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj``) of the kept layers into :mod:`~dyntree.common.fused_draft` layers served by the
CPU low-bit kernels, plus an int8 copy of the LM head; embeddings, norms and the RoPE table are
the target's own tensors (shared, no copy). Per speculation step it gathers each request's
committed prefix KV out of the runner's paged cache (:class:`~dyntree.vllm_plugin.kv_layout.KVLayout`
indices, planned once per step and shared by every layer) and keeps the draft tokens' KV in a
plugin-side scratch area (:class:`~dyntree.common.fused_draft.ScratchKV`) that is dropped when
the step ends: vLLM's cache is only read.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.nn import functional as F

from dyntree.common.drafter import DraftRequest
from dyntree.common.drafters.qspec import kept_layers
from dyntree.common.fused_draft import LM_HEAD_SPEC, FusedLayer, ScratchKV, attention_mask, fused_layer, hf_rope, run_layers
from dyntree.common.quant import QSpec, QSpecError, QuantLinear
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


def _weights(linear: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    return _dense(linear), getattr(linear, "bias", None)


def _fuse(layer: Any, index: int, spec: QSpec, kernel: CpuWeightOnly) -> FusedLayer:
    """One vLLM Llama decoder layer as a fused draft layer (refuses any other shape, naming it)."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    need = [(attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj"),
            (layer, "input_layernorm"), (layer, "post_attention_layernorm")]
    missing = [name for owner, name in need if getattr(owner, name, None) is None]
    rope = getattr(attn, "rotary_emb", None)
    if missing or rope is None:
        raise QSpecError(f"qspec inside vLLM drafts with Llama decoder layers; layer {index} "
                         f"({type(layer).__name__}) lacks {', '.join(missing) or 'rotary_emb'}")
    if getattr(attn.attn, "sliding_window", None) or getattr(attn, "q_norm", None) is not None:
        raise QSpecError(f"qspec inside vLLM: layer {index} uses a sliding window or q/k norms, which the draft does not run")
    norms = [(n.weight, float(n.variance_epsilon)) for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    fused = fused_layer(norms[0], _weights(attn.qkv_proj), _weights(attn.o_proj), norms[1],
                        _weights(mlp.gate_up_proj), _weights(mlp.down_proj), int(attn.num_heads),
                        int(attn.num_kv_heads), int(attn.head_dim), float(attn.scaling), spec, kernel)
    if fused is None:
        raise QSpecError(f"qspec inside vLLM: no CPU low-bit kernel serves layer {index}'s weights as {spec} "
                         "(use the default w8a16,perchannel or w4a16 with a group size that divides the hidden size)")
    return fused


class VllmSelfDraft:
    """Draft layers over vLLM's paged KV (see the module docstring).

    Args:
        model: vLLM's loaded Llama-family model (``model.model.layers``, ``model.lm_head``).
        proposer: the worker's :class:`~dyntree.vllm_plugin.proposer.DynTreeProposer`; its
            ``runner`` (KV caches, block tables) and ``req_ids`` (batch order) are read each step.
        spec: what to quantize (weight-only).
        vocab: the real vocabulary (vLLM pads its LM head).
    """

    def __init__(self, model: torch.nn.Module, proposer: Any, spec: QSpec, vocab: int) -> None:
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if layers is None or getattr(model, "lm_head", None) is None:
            raise QSpecError(f"qspec inside vLLM drafts with a Llama-family model; {type(model).__name__} has no "
                             "model.layers / lm_head")
        if spec.act_bits is not None or not spec.quantized:
            raise QSpecError(f"qspec inside vLLM runs weight-only quantized drafts (w8a16 or w4a16), not {spec}")
        device = next(model.parameters()).device
        if device.type != "cpu":
            raise QSpecError("qspec inside vLLM runs on CPU workers only (its GPU path is the standalone engine's)")
        kernel = CpuWeightOnly()
        kept = kept_layers(layers, spec)
        self.layers = [_fuse(layer, i, spec, kernel) for i, layer in enumerate(kept)]
        self.layer_names = [layer.self_attn.attn.layer_name for layer in kept]
        rope = kept[0].self_attn.rotary_emb
        if not rope.is_neox_style or int(rope.rotary_dim) != int(rope.head_size):
            raise QSpecError("qspec inside vLLM needs full-width neox-style RoPE (Llama's)")
        self.cos_sin = rope.cos_sin_cache  # [max_position, head_dim]: cos half, then sin half
        self.embed = inner.embed_tokens.weight
        self.norm = (inner.norm.weight, float(inner.norm.variance_epsilon))
        self.head = QuantLinear.from_weight(_dense(model.lm_head), None, LM_HEAD_SPEC, kernel=kernel)
        self.quant_layers = [m for f in self.layers for m in (f.qkv, f.o, f.gate_up, f.down)] + [self.head]
        for m in self.quant_layers:  # every call goes through the kernel: its packed copy is enough
            m.release_codes()
        self.proposer = proposer
        self.vocab = vocab
        self.dtype = self.embed.dtype
        self._kv = ScratchKV(len(self.layers))
        self._prefix: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._kv_lens = torch.zeros(0, dtype=torch.int64)

    @property
    def overhead_bytes(self) -> int:
        """Memory the draft adds to the target: its quantized weights (packed by the kernel)."""
        return sum(m.nbytes for m in self.quant_layers)

    def reset(self, requests: Sequence[DraftRequest]) -> None:
        """Gather each request's committed prefix KV (every draft layer) out of vLLM's cache."""
        runner = self.proposer.runner
        if runner is None:
            raise RuntimeError("dyntree qspec: the model runner is not known yet (the runner patch did not run)")
        row_of = {rid: i for i, rid in enumerate(self.proposer.req_ids)}
        block_tables = runner.input_batch.block_table[0].block_table.cpu
        block_rows = [block_tables[row_of[r.request_id]] for r in requests]
        lengths = [r.kv_len for r in requests]
        self._kv_lens = torch.tensor(lengths)
        context = runner.compilation_config.static_forward_context
        plans: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per cache layout, shared by its layers
        self._prefix = []
        for name in self.layer_names:
            layer = context[name]
            kv = layer.kv_cache[0] if isinstance(layer.kv_cache, (list, tuple)) else layer.kv_cache
            layout = KVLayout.of(kv, layer.isa)
            if id(layout) not in plans:
                plans[id(layout)] = layout.prefix_index(block_rows, lengths)
            self._prefix.append(tuple(layout.gather(kv, index, len(requests)).to(self.dtype)
                                      for index in plans[id(layout)]))  # type: ignore[arg-type]
        self._kv = ScratchKV(len(self.layers))

    def release(self) -> None:
        self._kv = ScratchKV(len(self.layers))
        self._prefix = []

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, scratch_mask: torch.Tensor) -> torch.Tensor:
        length = int(self._kv_lens.max()) if self._kv_lens.numel() else 0
        mask = attention_mask(self._kv_lens, length, scratch_mask, self.dtype)
        cos, sin = self.cos_sin[positions].to(self.dtype).chunk(2, dim=-1)
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
