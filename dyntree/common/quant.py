"""Weight and activation quantization for the quantized self-draft (QSpec-style).

Three pieces, all plain torch (framework-free):

* :class:`QSpec` and :func:`parse_qspec`: the draft-spec grammar behind
  ``--drafter qspec[:w8a16|w4a16|w4a8|w4a4][,gN|perchannel][,sym|asym][,skip=N]`` (or ``none``).
* :func:`quantize_weight` / :func:`dequantize_weight`: group-wise int8 / int4 weight
  quantization, symmetric or asymmetric, and :func:`fake_quantize_activations`: symmetric
  per-token activation quantization (8 or 4 bit), quantize-then-dequantize.
* :class:`QuantLinear`: a drop-in for ``nn.Linear`` holding only the quantized weight. Its
  forward runs a :class:`WeightKernel` the engine hands in where that kernel serves the weight
  (the W4A16 Triton kernel on CUDA, :mod:`dyntree.kernels.w4a16`; torch's weight-only int8/int4
  ops on CPU, :mod:`dyntree.kernels.cpu_weight_only`), else dequantizes on the fly (the torch
  reference path, any device).

Storage format (shared with the kernel). A weight ``W [N, K]`` (``nn.Linear`` layout: out, in) is
split along ``K`` into ``ceil(K / group_size)`` groups (the last may be shorter). Every value is
stored *unsigned*: ``u = clamp(round(W / s) + z, 0, 2**bits - 1)`` and ``W ~ (u - z) * s``, where
``s`` is the group's scale and ``z`` its zero point. Symmetric quantization has the implicit
zero point ``z = 2**(bits - 1)`` (so ``zeros is None``) and ``s = max|W| / (2**(bits-1) - 1)``;
asymmetric stores ``z = round(-lo / s)`` per group with ``s = (hi - lo) / (2**bits - 1)``, where
``[lo, hi]`` is the group's range widened to include 0.
Int8 codes are one ``uint8`` each (``[N, K]``); int4 codes are packed two per ``uint8`` along
``K`` (``[N, ceil(K / 2)]``, element ``2j`` in the low nibble, ``2j + 1`` in the high nibble).
Scales and zero points are ``[N, n_groups]`` (fp16 by default).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from dyntree.kernels.quant_format import QuantizedWeight, dequantize_weight, pack_int4, unpack_int4

__all__ = [
    "QSpec",
    "QSpecError",
    "parse_qspec",
    "QuantizedWeight",
    "quantize_weight",
    "dequantize_weight",
    "pack_int4",
    "unpack_int4",
    "fake_quantize_activations",
    "PreparedWeight",
    "QuantLinear",
    "WeightKernel",
]

_WEIGHT_BITS = (4, 8)
_ACT_BITS = (4, 8)
_MIN_GROUP, _MAX_GROUP = 32, 4096


class QSpecError(ValueError):
    """A ``qspec`` drafter spec is malformed (the message names the offending field)."""


@dataclass(frozen=True)
class QSpec:
    """What the quantized self-draft does to the target's weights and activations.

    Attributes:
        weight_bits: 4 or 8; ``None`` means no quantization at all (the draft is the target,
            possibly with layers skipped): the exactness baseline.
        act_bits: per-token activation bits (4 or 8), or ``None`` for 16-bit activations.
        group_size: weights per quantization group along the input dimension (a power of two in
            32..4096), or ``None`` for one group per output channel.
        symmetric: symmetric (implicit zero point) or asymmetric (stored zero points).
        skip_layers: how many of the last decoder layers the draft skips (early exit).
    """

    weight_bits: int | None = 8
    act_bits: int | None = None
    group_size: int | None = None
    symmetric: bool = True
    skip_layers: int = 0

    def __post_init__(self) -> None:
        if self.weight_bits is not None and self.weight_bits not in _WEIGHT_BITS:
            raise QSpecError(f"qspec: weight bits must be 4 or 8, got w{self.weight_bits}")
        if self.act_bits is not None and self.act_bits not in _ACT_BITS:
            raise QSpecError(f"qspec: activation bits must be 4, 8 or 16, got a{self.act_bits}")
        if self.weight_bits is None and self.act_bits is not None:
            raise QSpecError("qspec: activation quantization needs weight quantization (got none with act bits)")
        if self.group_size is not None and not (
            _MIN_GROUP <= self.group_size <= _MAX_GROUP and self.group_size & (self.group_size - 1) == 0
        ):
            raise QSpecError(
                f"qspec: group size must be a power of two in {_MIN_GROUP}..{_MAX_GROUP} "
                f"(or 'perchannel'), got g{self.group_size}"
            )
        if self.skip_layers < 0:
            raise QSpecError(f"qspec: skip must be a non-negative layer count, got skip={self.skip_layers}")

    @property
    def quantized(self) -> bool:
        return self.weight_bits is not None

    def __str__(self) -> str:
        """The canonical spec text, which :func:`parse_qspec` maps back to ``self``."""
        parts: list[str] = []
        if self.weight_bits is None:
            parts.append("none")
        else:
            parts.append(f"w{self.weight_bits}a{self.act_bits or 16}")
            parts.append("perchannel" if self.group_size is None else f"g{self.group_size}")
            parts.append("sym" if self.symmetric else "asym")
        if self.skip_layers:
            parts.append(f"skip={self.skip_layers}")
        return ",".join(parts)


_GRAMMAR = "w4a16|w8a16|w4a8|w4a4|w8a8|w8a4|none, gN|perchannel, sym|asym, skip=N"


def parse_qspec(options: str | None) -> QSpec:
    """Parse the options of ``qspec[:options]`` (comma-separated, any order, each at most once).

    ``None`` or ``""`` gives the default ``w8a16,perchannel,sym`` (the best measured draft:
    near-total acceptance, and the layout torch's CPU int8 kernel takes); an explicit precision
    without a group size gets ``g128``. ``none`` turns quantization off (it combines only with
    ``skip=N``). Raises :class:`QSpecError` naming the bad field.
    """
    fields: dict[str, object] = {}
    seen: dict[str, str] = {}

    def put(field: str, value: object, token: str) -> None:
        if field in seen:
            raise QSpecError(f"qspec: {field} given twice ({seen[field]!r} and {token!r})")
        seen[field] = token
        fields[field] = value

    for raw in (options or "").split(","):
        token = raw.strip().lower()
        if not token:
            if options and options.strip():
                raise QSpecError(f"qspec: empty field in {options!r}; expected {_GRAMMAR}")
            continue
        if m := re.fullmatch(r"w(\d+)a(\d+)", token):
            wb, ab = int(m.group(1)), int(m.group(2))
            if wb not in _WEIGHT_BITS:
                raise QSpecError(f"qspec: weight bits must be 4 or 8, got {token!r}")
            if ab not in (*_ACT_BITS, 16):
                raise QSpecError(f"qspec: activation bits must be 4, 8 or 16, got {token!r}")
            put("precision", (wb, None if ab == 16 else ab), token)
        elif token == "none":
            put("precision", (None, None), token)
        elif m := re.fullmatch(r"g(-?\d+)", token):
            put("group size", int(m.group(1)), token)
        elif token in ("perchannel", "per-channel"):
            put("group size", None, token)
        elif token in ("sym", "asym"):
            put("symmetry", token == "sym", token)
        elif m := re.fullmatch(r"skip=(.*)", token):
            if not re.fullmatch(r"\d+", m.group(1)):
                raise QSpecError(f"qspec: skip must be a non-negative layer count, got {token!r}")
            put("skip", int(m.group(1)), token)
        else:
            raise QSpecError(f"qspec: unknown field {raw.strip()!r}; expected {_GRAMMAR}")

    weight_bits, act_bits = fields.get("precision", (8, None))  # type: ignore[misc]
    default_group = 128 if "precision" in seen else None
    if weight_bits is None and ("group size" in seen or "symmetry" in seen):
        extra = seen.get("group size") or seen.get("symmetry")
        raise QSpecError(f"qspec: 'none' turns quantization off; {extra!r} does not apply")
    return QSpec(
        weight_bits=weight_bits,  # type: ignore[arg-type]
        act_bits=act_bits,  # type: ignore[arg-type]
        group_size=fields.get("group size", default_group) if weight_bits is not None else None,  # type: ignore[arg-type]
        symmetric=bool(fields.get("symmetry", True)),
        skip_layers=int(fields.get("skip", 0)),  # type: ignore[call-overload]
    )


# -- weights -----------------------------------------------------------------------------------


def _group_view(w: torch.Tensor, group: int) -> torch.Tensor:
    """``[N, K]`` -> ``[N, G, group]``; a short last group is padded by repeating its last
    column, which leaves the group's min, max and max-abs unchanged."""
    n, k = w.shape
    pad = -k % group
    if pad:
        w = torch.cat((w, w[:, -1:].expand(n, pad)), dim=1)
    return w.reshape(n, -1, group)


def _stored_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale`` in ``dtype``, rounded *up* (and at least the smallest normal number): a stored
    scale never smaller than the exact one keeps the group's range inside the code range, so
    clamping never costs more than half a step."""
    scale = scale.clamp_min(torch.finfo(dtype).tiny)
    stored = scale.to(dtype)
    if not bool(torch.isfinite(stored).all()):
        raise ValueError(f"quantize_weight: a group scale overflows {dtype}; use scale_dtype=torch.float32")
    return torch.where(stored.float() < scale, torch.nextafter(stored, torch.full_like(stored, torch.inf)), stored)


def quantize_weight(
    w: torch.Tensor,
    bits: int,
    group_size: int | None = 128,
    symmetric: bool = True,
    scale_dtype: torch.dtype = torch.float16,
) -> QuantizedWeight:
    """Quantize a ``[N, K]`` weight group-wise (``group_size=None``: per output channel).

    Round-to-nearest; every reconstructed value is within half its group's (stored) scale of the
    original. Computation is in fp32 whatever the input dtype.
    """
    if bits not in _WEIGHT_BITS:
        raise ValueError(f"quantize_weight: bits must be 4 or 8, got {bits}")
    if w.dim() != 2 or w.numel() == 0:
        raise ValueError(f"quantize_weight: weight must be a non-empty 2-D [out, in] tensor, got {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_weight: weight has non-finite values")
    n, k = w.shape
    group = k if group_size is None else group_size
    if group <= 0:
        raise ValueError(f"quantize_weight: group_size must be positive, got {group_size}")
    g = _group_view(w.detach().float(), group)  # [N, G, group]
    qmax_u = 2**bits - 1
    if symmetric:
        half = 2 ** (bits - 1)
        scale = _stored_scale(g.abs().amax(dim=2) / (half - 1), scale_dtype)
        zero_f = torch.full_like(scale, half, dtype=torch.float32)
        zeros = None
    else:
        lo, hi = g.amin(dim=2).clamp_max(0), g.amax(dim=2).clamp_min(0)  # keep 0 representable
        scale = _stored_scale((hi - lo) / qmax_u, scale_dtype)
        zero_f = torch.round(-lo / scale.float()).clamp(0, qmax_u)
        zeros = zero_f.to(scale_dtype)
    codes = torch.round(g / scale.float().unsqueeze(2)) + zero_f.unsqueeze(2)
    codes = codes.clamp(0, qmax_u).to(torch.uint8).reshape(n, -1)[:, :k]
    qweight = pack_int4(codes) if bits == 4 else codes.contiguous()
    return QuantizedWeight(qweight, scale.contiguous(), zeros, bits, group, k)




# -- activations -------------------------------------------------------------------------------
def fake_quantize_activations(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric per-token quantization of ``x [..., K]`` to ``bits``, returned dequantized in
    ``x.dtype`` (every element within half its token's scale ``max|x| / (2**(bits-1) - 1)``).

    The product of these values with dequantized weights equals, up to fp32 rounding, what an
    integer GEMM with per-token and per-group rescaling computes."""
    if bits not in _ACT_BITS:
        raise ValueError(f"fake_quantize_activations: bits must be 4 or 8, got {bits}")
    qmax = 2 ** (bits - 1) - 1
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / qmax).clamp_min(torch.finfo(torch.float32).tiny)
    return (torch.round(xf / scale).clamp(-qmax, qmax) * scale).to(x.dtype)


# -- the layer ---------------------------------------------------------------------------------
class PreparedWeight(Protocol):
    """A weight in a kernel's own layout (packed once, when the layer is built)."""

    @property
    def extra_nbytes(self) -> int:
        """Bytes it holds beyond the :class:`QuantizedWeight` it came from (0 if it shares them)."""
        ...


class WeightKernel(Protocol):
    """A device matmul for quantized weights, handed to :class:`QuantLinear` by the engine (this
    module never imports kernels)."""

    def prepare(self, qw: QuantizedWeight) -> PreparedWeight | None:
        """``qw`` in the kernel's layout, or ``None`` when the kernel cannot serve this weight
        (bits, group size, shape or device)."""
        ...

    def matmul(self, x: torch.Tensor, prepared: PreparedWeight) -> torch.Tensor | None:
        """``x [M, K] @ deq(W)^T`` in ``x.dtype``, or ``None`` when this call is not one the
        kernel takes (device, dtype); the layer then dequantizes."""
        ...

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The activation dtype the kernel computes in for ``dtype`` inputs: a caller that keeps
        activations in it skips the casts in and out of every call."""
        ...


class QuantLinear(nn.Module):
    """``nn.Linear`` with a quantized weight (and optionally quantized input activations).

    The bias, if any, is kept as given (shared with the source layer, not copied). Forward:
    ``y = fq(x) @ deq(W)^T + b`` computed in ``x.dtype``, where ``fq`` is
    :func:`fake_quantize_activations` when ``act_bits`` is set. With 16-bit activations the
    weight goes through ``kernel`` when one is given and it prepares this weight and takes the
    call; everything else dequantizes on the fly (no dequantized copy is kept).
    """

    def __init__(
        self,
        qweight: QuantizedWeight,
        bias: torch.Tensor | None = None,
        act_bits: int | None = None,
        kernel: WeightKernel | None = None,
    ):
        super().__init__()
        if act_bits is not None and act_bits not in _ACT_BITS:
            raise ValueError(f"QuantLinear: act_bits must be 4, 8 or None, got {act_bits}")
        if bias is not None and bias.shape != (qweight.out_features,):
            raise ValueError(f"QuantLinear: bias shape {tuple(bias.shape)} != ({qweight.out_features},)")
        self.in_features = qweight.in_features
        self.out_features = qweight.out_features
        self.bits = qweight.bits
        self.group_size = qweight.group_size
        self.act_bits = act_bits
        self.register_buffer("qweight", qweight.qweight)
        self.register_buffer("scales", qweight.scales)
        self.register_buffer("zeros", qweight.zeros)
        self.bias = bias
        self._prepared = kernel.prepare(qweight) if kernel is not None and act_bits is None else None
        self.kernel = kernel if self._prepared is not None else None
        self._dense: torch.Tensor | None = None
        self._released = False

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        spec: QSpec,
        scale_dtype: torch.dtype = torch.float16,
        kernel: WeightKernel | None = None,
    ) -> "QuantLinear":
        """Quantize ``linear`` as ``spec`` says (``spec`` must quantize)."""
        return cls.from_weight(linear.weight, linear.bias, spec, scale_dtype, kernel)

    @classmethod
    def from_weight(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        spec: QSpec,
        scale_dtype: torch.dtype = torch.float16,
        kernel: WeightKernel | None = None,
    ) -> "QuantLinear":
        """``x @ weight.T + bias`` quantized as ``spec`` says (``spec`` must quantize); for weights
        that no ``nn.Linear`` holds (stacked projections, an engine's packed layers)."""
        if spec.weight_bits is None:
            raise ValueError("QuantLinear: spec 'none' does not quantize")
        qw = quantize_weight(weight.detach(), spec.weight_bits, spec.group_size, spec.symmetric, scale_dtype)
        return cls(qw, bias, spec.act_bits, kernel)

    @property
    def quantized_weight(self) -> QuantizedWeight:
        if self._released:
            raise ValueError("QuantLinear: the codes were released (the layer runs only through its kernel)")
        return QuantizedWeight(self.qweight, self.scales, self.zeros, self.bits, self.group_size, self.in_features)

    @property
    def nbytes(self) -> int:
        """Bytes this layer owns (codes, scales, zero points unless released; the shared bias is
        not counted), plus the kernel's packed copy and the dense copy if :meth:`materialize` made one."""
        dense = 0 if self._dense is None else self._dense.numel() * self._dense.element_size()
        packed = 0 if self._prepared is None else self._prepared.extra_nbytes
        own = [self.qweight, self.scales] + ([self.zeros] if self.zeros is not None else [])
        return sum(t.numel() * t.element_size() for t in own) + dense + packed

    def release_codes(self) -> None:
        """Drop the codes in the common format once the kernel holds its own copy (half the
        layer's memory); from then on the layer runs only through its kernel."""
        if self._prepared is None:
            raise ValueError("QuantLinear.release_codes: no kernel holds a copy of this weight")
        self.qweight, self.scales = self.qweight.new_empty(0), self.scales.new_empty(0)
        self.zeros = None if self.zeros is None else self.zeros.new_empty(0)
        self._released = True

    def materialize(self, dtype: torch.dtype) -> None:
        """Keep a dequantized ``dtype`` copy of the weight and use it instead of dequantizing on
        every call (and instead of the kernel): the reference numbers, faster than dequantizing,
        but it costs a full dense weight. For measuring acceptance only; it defeats the memory
        saving."""
        self._dense = dequantize_weight(self.quantized_weight, dtype)
        self.kernel = self._prepared = None

    def kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, in]`` (in the kernel's :meth:`~WeightKernel.compute_dtype`) through the kernel,
        bias added, in that dtype: a fused draft's hot path, without the module call and the
        checks and fallbacks of :meth:`forward`."""
        assert self.kernel is not None and self._prepared is not None
        y = self.kernel.matmul(x, self._prepared)
        if y is None:
            raise RuntimeError(f"QuantLinear: the kernel refused a {x.dtype} call on {x.device}")
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"QuantLinear: input last dim {x.shape[-1]} != in_features {self.in_features}")
        if self.act_bits is not None:
            x = fake_quantize_activations(x, self.act_bits)
        flat = x.dim() == 2  # rows already: no reshape in or out (each is a dispatcher call)
        x2 = x if flat else x.reshape(-1, self.in_features)
        y = None
        if self.kernel is not None and self._prepared is not None:
            y = self.kernel.matmul(x2, self._prepared)
        if y is None and self._released:
            raise RuntimeError(f"QuantLinear: the kernel refused a {x.dtype} call on {x.device} and the codes "
                               "were released (nothing to dequantize)")
        if y is None and self._dense is not None and self._dense.dtype == x.dtype:
            y = x2 @ self._dense.t()
        elif y is None:
            y = x2 @ dequantize_weight(self.quantized_weight, x.dtype).t()
        if self.bias is not None:
            y = y + (self.bias if self.bias.dtype == y.dtype else self.bias.to(y.dtype))
        return y if flat else y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        act = f"a{self.act_bits}" if self.act_bits else "a16"
        sym = "sym" if self.zeros is None else "asym"
        kernel = f", kernel={type(self.kernel).__name__}" if self.kernel is not None else ""
        return f"in={self.in_features}, out={self.out_features}, w{self.bits}{act}, g{self.group_size}, {sym}{kernel}"

