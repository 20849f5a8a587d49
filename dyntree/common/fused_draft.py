"""The quantized self-draft's decoder layers as a few fused ops each, for Llama targets (any engine).

Run through Hugging Face's decoder, a draft forward of SmolLM2-135M on a CPU spends about two
thirds of its time outside the low-bit matmuls: per layer, seven projection calls (each with its
activation casts), the rotary and RMSNorm written as chains of small ops, ``repeat_kv`` for grouped
heads, and module-call overhead, which made a draft forward cost ~0.7 of a target forward. This
module computes the same layer:

    h = x + o(attn(rope(q), rope(k), v))   with q, k, v = split(qkv(rms_norm(x)))
    y = h + down(silu(gate) * up)          with gate, up = split(gate_up(rms_norm(h)))

with the target's projections stacked and quantized as one weight each (the same codes and scales
as quantizing them one by one: every output row has its own), :func:`rms_norm` as three ops and
:func:`~dyntree.kernels.cpu_attention.attend` (grouped-query attention, by the routing the caller
passes). It reads the target's norms and rotary, so it is the draft the HF path runs, up to float rounding
and the norms' epsilon, without the HF path's per-projection copies; :func:`fuse_layers` returns
``None`` (and the caller keeps the HF path) for any layer that is not exactly that shape, or
whose stacked projections no kernel serves. An engine whose layers already hold stacked weights
(vLLM's ``qkv_proj`` / ``gate_up_proj``) builds the same layers with :func:`fused_layer`.

An engine's self-draft backend runs these layers (:func:`run_layers`) under :func:`attention_mask`
against each request's committed prefix KV (read-only, the engine's own cache) plus this step's
draft tokens' KV (:class:`ScratchKV`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from dyntree.kernels.cpu_attention import AttentionDispatch, attend
from dyntree.common.kv_store import KVStore, append_kv
from dyntree.common.quant import QSpec, QuantLinear, WeightKernel

__all__ = ["LM_HEAD_SPEC", "FusedLayer", "fused_layer", "fuse_layers", "hf_rope", "run_layers", "attention_mask",
           "ScratchKV", "Rope", "rms_norm", "norm_weight"]

#: The draft's LM head: per-channel int8 (its top-1 barely moves).
LM_HEAD_SPEC = QSpec(weight_bits=8, group_size=None)

#: ``rope(x)`` rotates ``[b, heads, w, head_dim]`` queries or keys at this forward's positions.
Rope = Callable[[torch.Tensor], torch.Tensor]

_MODEL_TYPES = ("llama",)


@dataclass(frozen=True)
class FusedLayer:
    """One decoder layer's weights in fused form (the norms' weights as :func:`rms_norm` takes
    them: :func:`norm_weight`, a scaled copy of the target's)."""

    attn_norm: torch.Tensor
    qkv: QuantLinear
    o: QuantLinear
    mlp_norm: torch.Tensor
    gate_up: QuantLinear
    down: QuantLinear
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float


def _norm(module: nn.Module) -> torch.Tensor | None:
    """An RMSNorm module's weight (``None`` for any other module)."""
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor) and isinstance(eps, float):
        return weight
    return None


def _stacked(parts: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias of ``cat([p(x) for p in parts], -1)`` as one linear."""
    weight = torch.cat([p.weight for p in parts]) if len(parts) > 1 else parts[0].weight
    bias = None
    if any(p.bias is not None for p in parts):
        bias = torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.out_features) for p in parts])
    return weight, bias


def fused_layer(
    attn_norm: torch.Tensor,
    qkv: tuple[torch.Tensor, torch.Tensor | None],
    o: tuple[torch.Tensor, torch.Tensor | None],
    mlp_norm: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor | None],
    down: tuple[torch.Tensor, torch.Tensor | None],
    heads: int,
    kv_heads: int,
    head_dim: int,
    scaling: float,
    spec: QSpec,
    kernel: WeightKernel,
) -> FusedLayer | None:
    """One Llama layer from its weights (the RMSNorms' weights, their epsilon left out (see
    :func:`rms_norm`); ``(weight, bias)`` projections: q/k/v stacked in that order, gate/up
    stacked), quantized as ``spec`` says; ``None`` when
    ``kernel`` does not serve a stacked weight."""

    def quantized(weight: torch.Tensor, bias: torch.Tensor | None) -> QuantLinear:
        return QuantLinear.from_weight(weight, bias, spec, kernel=kernel)

    fused = FusedLayer(norm_weight(attn_norm), quantized(*qkv), quantized(*o), norm_weight(mlp_norm),
                       quantized(*gate_up), quantized(*down), heads, kv_heads, head_dim, scaling)
    if any(p.kernel is None for p in (fused.qkv, fused.o, fused.gate_up, fused.down)):
        return None
    return fused


def _fuse(layer: nn.Module, config: Any, spec: QSpec, kernel: WeightKernel) -> FusedLayer | None:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = _norm(getattr(layer, "input_layernorm", None)), _norm(getattr(layer, "post_attention_layernorm", None))
    names = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
    if attn is None or mlp is None or any(n is None for n in norms):
        return None
    if any(hasattr(attn, n) for n in ("q_norm", "k_norm")):
        return None
    proj = [getattr(attn, n, None) for n in names[0]] + [getattr(mlp, n, None) for n in names[1]]
    if not all(isinstance(p, nn.Linear) for p in proj):
        return None
    if "SiLU" not in type(getattr(mlp, "act_fn", None)).__name__ or getattr(config, "hidden_act", None) != "silu":
        return None
    q, k, v, o, gate, up, down = proj
    head_dim = int(attn.head_dim)
    return fused_layer(norms[0], _stacked([q, k, v]), _stacked([o]), norms[1], _stacked([gate, up]), _stacked([down]),
                       q.out_features // head_dim, k.out_features // head_dim, head_dim, float(attn.scaling), spec, kernel)


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


def norm_weight(weight: torch.Tensor) -> torch.Tensor:
    """An RMSNorm weight ``w`` (over ``d`` features) as :func:`rms_norm` takes it: ``w * sqrt(d)``."""
    return (weight * weight.shape[-1] ** 0.5).detach()


def rms_norm(x: torch.Tensor, scaled_weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm of ``x [..., d]`` with weight ``w`` given as :func:`norm_weight` ``(w)``, without the
    epsilon: ``x / ||x|| * w * sqrt(d)`` (three ops, against a chain of reductions for torch's
    ``rms_norm``; a draft forward pays two per layer). Leaving out the epsilon changes a row by a
    relative ``eps / (2 mean(x**2))``: for SmolLM2 (eps 1e-5, the smallest ``mean(x**2)`` of an
    embedding row 0.0056) at most ~1e-3, and the residual stream only grows from there."""
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True) * scaled_weight


def hf_rope(cos: torch.Tensor, sin: torch.Tensor) -> Rope:
    """The rotation a Hugging Face rotary module's ``cos``/``sin [b, w, head_dim]`` describe:
    ``x * cos + rotate_half(x) * sin``, with ``rotate_half(x) = roll(x, half) * [-1.., +1..]``
    (the sign folded into ``sin`` once per forward, so a call is three ops)."""
    half = cos.shape[-1] // 2
    cos, signed = cos[:, None], torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, None]
    return lambda x: torch.addcmul(x * cos, x.roll(half, -1), signed)


def run_layers(layers: Sequence[FusedLayer], hidden: torch.Tensor, rope: Rope, mask: torch.Tensor | None,
               kv: Any, attention: AttentionDispatch | None = None) -> torch.Tensor:
    """``hidden [b, w, d]`` through ``layers``; ``rope`` rotates queries and keys (``[b, heads, w,
    head_dim]``, rotated together) at this forward's positions, ``mask [b, 1, w, keys]`` is
    additive, ``kv.update(k, v, layer_idx)`` appends this call's keys/values and returns every
    key/value the queries may see (the HF cache contract; :class:`ScratchKV`).

    The residual stream, rotary and attention stay in ``hidden``'s dtype; each projection's input
    is cast once to the kernel's compute dtype and its output is used in that dtype (added to the
    residual or split), which gives the numbers of casting in and out of every call with fewer
    casts (on a CPU: bf16 for torch's int8/int4 ops). ``mask=None`` (every query sees every key)
    lets attention take its unmasked kernels; ``attention``: the engine's CPU attention routing
    (:func:`~dyntree.kernels.cpu_attention.attend`; ``None``: ``gqa``)."""
    if not layers:
        return hidden
    b, w, d = hidden.shape
    dtype = hidden.dtype
    kernel = layers[0].qkv.kernel  # fused layers run only through their kernel (see fused_layer)
    assert kernel is not None
    act = kernel.compute_dtype(dtype)
    for i, f in enumerate(layers):
        x = rms_norm(hidden, f.attn_norm).reshape(b * w, d).to(act)
        qkv = f.qkv.kernel_forward(x).to(dtype).view(b, w, f.heads + 2 * f.kv_heads, f.head_dim).transpose(1, 2)
        q, k = rope(qkv[:, : f.heads + f.kv_heads]).split([f.heads, f.kv_heads], dim=1)
        keys, values = kv.update(k, qkv[:, f.heads + f.kv_heads :], i)
        att = attend(q, keys, values, mask, f.scaling, attention).transpose(1, 2).reshape(b * w, f.heads * f.head_dim)
        hidden = hidden + f.o.kernel_forward(att.to(act)).view(b, w, d)
        x = rms_norm(hidden, f.mlp_norm).reshape(b * w, d).to(act)
        gate, up = f.gate_up.kernel_forward(x).chunk(2, dim=-1)
        hidden = hidden + f.down.kernel_forward((F.silu(gate.to(dtype)) * up).to(act)).view(b, w, d)
    return hidden


def attention_mask(kv_lens: torch.Tensor, prefix_len: int, scratch_mask: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor | None:
    """``[B, 1, W, prefix_len + S + W]`` additive mask of a draft forward: query ``(b, w)`` sees the
    first ``kv_lens[b]`` of the ``prefix_len`` prefix columns (its committed KV) and the scratch
    slots ``scratch_mask [B, W, S + W]`` allows; ``None`` when it would hide nothing (a chain's
    forward at batch 1, or rows of one length)."""
    b, w, _ = scratch_mask.shape
    see_prefix = (torch.arange(prefix_len)[None, :] < kv_lens[:, None])[:, None, :].expand(b, w, prefix_len)
    allowed = torch.cat([see_prefix, scratch_mask], dim=-1)
    if bool(allowed.all()):
        return None
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


class ScratchKV:
    """The cache object a draft forward writes to: per layer, the target's prefix KV (read-only,
    set by the engine for each forward of a step) followed by this step's draft tokens' KV
    (scratch, owned).

    Attention needs a layer's keys in one tensor. While a copy of the step's prefix KV for every
    layer fits ``copy_budget`` bytes, a layer's first call of the step copies its prefix once into
    a buffer with room for the draft tokens, and later calls only write their own keys into it
    (a draft step runs several forwards against the same prefix). Past the budget (long contexts,
    large batches) nothing is kept: every call concatenates the layer's prefix with its scratch for
    the duration of the call, so the draft never holds a second full cache. An engine whose cache
    buffer has free slots after a layer's prefix lends them (:meth:`lend`): no copy at all."""

    #: Bytes of prefix copies a step may hold (SmolLM2, fp32: ~46 KB per cached token and request).
    COPY_BUDGET = 256 << 20

    def __init__(self, n_layers: int, copy_budget: int = COPY_BUDGET) -> None:
        self.prefix: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_layers
        self.scratch: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_layers
        self.copy_budget = copy_budget
        self._buffers: list[tuple[KVStore, int] | None] = [None] * n_layers  # storage, prefix length
        self._lent = [False] * n_layers  # the layer's storage is the engine's (not a copy)
        self.peak_transient_bytes = 0  # the most prefix-copy bytes held at once

    def lend(self, layer_idx: int, store: KVStore, length: int) -> None:
        """This step, the layer's draft tokens' KV may go into ``store``'s slots from ``length`` on,
        after its first ``length`` slots, which must be the layer's prefix (an engine lends the free
        slots of its own cache buffer, which its next forward overwrites): no prefix copy. When the
        draft outgrows the free slots, the layer moves to a copy of its own, as without a loan."""
        self._buffers[layer_idx] = (KVStore(store.buffer, length), length)
        self._lent[layer_idx] = True

    @property
    def needs_prefix(self) -> bool:
        """Whether some layer still reads its prefix from :attr:`prefix` (neither lent nor copied)."""
        return any(b is None for b in self._buffers)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        pre = self.prefix[layer_idx]
        if self._buffers[layer_idx] is not None or (
                pre is not None and 2 * pre[0].numel() * pre[0].element_size() * len(self.prefix) <= self.copy_budget):
            return self._buffered(layer_idx, pre, key, value)
        old = self.scratch[layer_idx]
        self.scratch[layer_idx] = (key, value) if old is None else (torch.cat([old[0], key], 2), torch.cat([old[1], value], 2))
        k, v = self.scratch[layer_idx]
        if pre is None:
            return k, v
        full_k, full_v = torch.cat([pre[0], k], 2), torch.cat([pre[1], v], 2)
        self.peak_transient_bytes = max(self.peak_transient_bytes, 2 * full_k.numel() * full_k.element_size())
        return full_k, full_v

    def _buffered(self, layer_idx: int, pre: tuple[torch.Tensor, torch.Tensor] | None, key: torch.Tensor,
                  value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``key``/``value`` after the layer's prefix (lent, or copied) and earlier draft
        tokens; returns views of everything written so far. The first call of a step copies the
        prefix unless it was lent; a call that does not fit the room left moves the buffer to one
        with twice the draft slots."""
        entry = self._buffers[layer_idx]
        if entry is None:
            assert pre is not None
            keys, values, store, length = pre[0], pre[1], None, pre[0].shape[2]
        else:
            store, length = entry
            n, t = store.used, key.shape[2]
            if n + t <= store.keys.shape[2]:  # room left (this object's own count): write in place
                store.keys.narrow(2, n, t).copy_(key)
                store.values.narrow(2, n, t).copy_(value)
                store.used = n + t
                return store.keys.narrow(2, 0, n + t), store.values.narrow(2, 0, n + t)
            keys, values = store.keys.narrow(2, 0, n), store.values.narrow(2, 0, n)
        drafted = keys.shape[2] - length + key.shape[2]
        k, v, new = append_kv(keys, values, key, value, store, max(16, 2 * drafted) - drafted)
        self._buffers[layer_idx] = (new, length)
        if new is not store:
            self._lent[layer_idx] = False
            held = sum(b[0].nbytes for b, lent in zip(self._buffers, self._lent) if b is not None and not lent)
            self.peak_transient_bytes = max(self.peak_transient_bytes, held)
        return k, v

    def _drafted(self, layer_idx: int) -> torch.Tensor | None:
        """The layer's draft-token keys so far (a view into its buffer, or its own scratch)."""
        entry = self._buffers[layer_idx]
        if entry is not None:
            return entry[0].keys[:, :, entry[1] : entry[0].used]
        scr = self.scratch[layer_idx]
        return None if scr is None else scr[0]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        pre, drafted = self.prefix[layer_idx], self._drafted(layer_idx)
        return (0 if pre is None else pre[0].shape[2]) + (0 if drafted is None else drafted.shape[2])

    @property
    def scratch_bytes(self) -> int:
        keys = [self._drafted(i) for i in range(len(self.scratch))]
        return sum(2 * k.numel() * k.element_size() for k in keys if k is not None)
