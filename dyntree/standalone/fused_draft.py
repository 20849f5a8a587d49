"""The quantized self-draft's decoder layers as a few fused ops each, for Llama targets.

Run through Hugging Face's decoder, a draft forward of SmolLM2-135M on a CPU spends about two
thirds of its time outside the low-bit matmuls: per layer, seven projection calls (each with its
activation casts), the rotary and RMSNorm written as chains of small ops, ``repeat_kv`` for grouped
heads, and module-call overhead, which made a draft forward cost ~0.7 of a target forward. This
module computes the same layer:

    h = x + o(attn(rope(q), rope(k), v))   with q, k, v = split(qkv(rms_norm(x)))
    y = h + down(silu(gate) * up)          with gate, up = split(gate_up(rms_norm(h)))

with the target's projections stacked and quantized as one weight each (the same codes and scales
as quantizing them one by one: every output row has its own), torch's fused ``rms_norm`` and
grouped-query SDPA. It reads the target's norms and rotary, so it is the draft the HF path runs, up
to float rounding, without the HF path's per-projection copies; :func:`fuse_layers` returns
``None`` (and the caller keeps the HF path) for any layer that is not exactly that shape, or whose
stacked projections no kernel serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from dyntree.common.quant import QSpec, QuantLinear, WeightKernel, quantize_weight

__all__ = ["FusedLayer", "fuse_layers", "run_layers"]

_MODEL_TYPES = ("llama",)


@dataclass(frozen=True)
class FusedLayer:
    """One decoder layer's weights in fused form (the norms' tensors are the target's own)."""

    attn_norm: torch.Tensor
    attn_eps: float
    qkv: QuantLinear
    o: QuantLinear
    mlp_norm: torch.Tensor
    mlp_eps: float
    gate_up: QuantLinear
    down: QuantLinear
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float


def _norm(module: nn.Module) -> tuple[torch.Tensor, float] | None:
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor) and isinstance(eps, float):
        return weight, eps
    return None


def _stacked(parts: Sequence[nn.Linear], spec: QSpec, kernel: WeightKernel) -> QuantLinear:
    """``cat([p(x) for p in parts], -1)`` as one quantized layer."""
    assert spec.weight_bits is not None  # fuse_layers only fuses quantizing specs
    weight = torch.cat([p.weight.detach() for p in parts]) if len(parts) > 1 else parts[0].weight.detach()
    qw = quantize_weight(weight, spec.weight_bits, spec.group_size, spec.symmetric)
    bias = None
    if any(p.bias is not None for p in parts):
        bias = torch.cat([p.bias.detach() if p.bias is not None else p.weight.new_zeros(p.out_features) for p in parts])
    return QuantLinear(qw, bias, None, kernel)


def _fuse(layer: nn.Module, config: Any, spec: QSpec, kernel: WeightKernel) -> FusedLayer | None:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = _norm(getattr(layer, "input_layernorm", None)), _norm(getattr(layer, "post_attention_layernorm", None))
    names = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
    if attn is None or mlp is None or None in norms or any(hasattr(attn, n) for n in ("q_norm", "k_norm")):
        return None
    proj = [getattr(attn, n, None) for n in names[0]] + [getattr(mlp, n, None) for n in names[1]]
    if not all(isinstance(p, nn.Linear) for p in proj):
        return None
    if "SiLU" not in type(getattr(mlp, "act_fn", None)).__name__ or getattr(config, "hidden_act", None) != "silu":
        return None
    q, k, v, o, gate, up, down = proj
    head_dim = int(attn.head_dim)
    fused = FusedLayer(norms[0][0], norms[0][1], _stacked([q, k, v], spec, kernel), _stacked([o], spec, kernel),
                       norms[1][0], norms[1][1], _stacked([gate, up], spec, kernel), _stacked([down], spec, kernel),
                       q.out_features // head_dim, k.out_features // head_dim, head_dim, float(attn.scaling))
    if any(p.kernel is None for p in (fused.qkv, fused.o, fused.gate_up, fused.down)):
        return None
    return fused


def fuse_layers(layers: Sequence[nn.Module], config: Any, spec: QSpec,
                kernel: WeightKernel | None) -> list[FusedLayer] | None:
    """The target's ``layers`` as fused draft layers quantized as ``spec`` says, or ``None`` when
    ``spec`` quantizes activations (or nothing), any layer is not a plain Llama layer, or
    ``kernel`` does not serve the stacked weights (then no fused layer is kept)."""
    if kernel is None or not spec.quantized or spec.act_bits is not None:
        return None
    if getattr(config, "model_type", None) not in _MODEL_TYPES:
        return None
    fused = []
    for layer in layers:
        f = _fuse(layer, config, spec, kernel)
        if f is None:
            return None
        fused.append(f)
    return fused


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def run_layers(layers: Sequence[FusedLayer], hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               mask: torch.Tensor, kv: Any) -> torch.Tensor:
    """``hidden [b, w, d]`` through ``layers``; ``cos``/``sin [b, w, head_dim]`` from the target's
    rotary module, ``mask [b, 1, w, keys]`` additive, ``kv.update(k, v, layer_idx)`` appends this
    call's keys/values and returns every key/value the queries may see (the HF cache contract)."""
    b, w, _ = hidden.shape
    cos, sin = cos[:, None], sin[:, None]
    for i, f in enumerate(layers):
        x = F.rms_norm(hidden, hidden.shape[-1:], f.attn_norm, f.attn_eps)
        qkv = f.qkv(x).view(b, w, f.heads + 2 * f.kv_heads, f.head_dim).transpose(1, 2)
        q, k, v = qkv.split([f.heads, f.kv_heads, f.kv_heads], dim=1)
        keys, values = kv.update(_rope(k, cos, sin), v, i)
        att = F.scaled_dot_product_attention(_rope(q, cos, sin), keys, values, attn_mask=mask, scale=f.scaling,
                                             enable_gqa=f.heads != f.kv_heads)
        hidden = hidden + f.o(att.transpose(1, 2).reshape(b, w, f.heads * f.head_dim))
        x = F.rms_norm(hidden, hidden.shape[-1:], f.mlp_norm, f.mlp_eps)
        gate, up = f.gate_up(x).chunk(2, dim=-1)
        hidden = hidden + f.down(F.silu(gate) * up)
    return hidden
