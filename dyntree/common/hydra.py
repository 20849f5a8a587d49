"""Hydra draft heads: the trained, sequentially dependent drafter's model and its configuration
(checkpoint files: :mod:`dyntree.common.hydra_checkpoint`; drafting: :mod:`dyntree.common.drafters.hydra`).

Head ``k`` (1-based) reads the target's last-layer hidden state ``h_t`` (after the final norm:
the LM-head input at the committed token before the root) together with the input embeddings of
the ``k`` tokens already on the path (root ``x_{t+1}``, then the tokens heads ``1..k-1`` chose)
and predicts token ``x_{t+k+1}``::

    z = W_in[k] @ concat(h_t, emb(x_{t+1}), ..., emb(x_{t+k}))      # (k+1)*d -> d
    z = z + SiLU(W_l z)   for each of the head's residual layers
    logits = lm_head_rows @ z                                         # frozen target LM head

The independent ablation (Medusa-style, ``independent=True``) cuts the sequential input: every
head sees only ``h_t`` and the committed root's embedding, never a drafted token.

Prefix attention (Hydra++, ``prefix_attention=True``): one extra small decoder layer
(:class:`PrefixAttention`: pre-norm RMSNorm, causal multi-head self-attention with RoPE on absolute
positions, SwiGLU MLP, residuals) runs over the target's last-layer hidden states of the whole
committed prefix, with its own KV cache (:class:`PrefixKV`); its output at the newest position
(the token before the root) replaces ``h_t`` as the heads' input. The layer's output projections
start at zero, so an untrained layer is the identity (``h_t`` passes through unchanged).

The output goes through the target's frozen LM head, either in full or restricted to a reduced
vocabulary (the ``V`` most frequent tokens of the training data, ``token_map[j]`` = full id of
reduced id ``j``). The target's embedding and LM-head weights are borrowed at load time and never
stored: a checkpoint directory holds ``model.safetensors`` (the head weights and the token map) and
``config.json`` (:class:`HydraConfig`, including the :class:`TargetIdentity` of the target it was
trained on); loading checks that identity and refuses a mismatch naming the dimension.

Torch only: this module never imports transformers.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from dyntree.common.kv_store import KVStore, append_kv
from dyntree.kernels.cpu_linear import LinearRouter, install
from dyntree.kernels.cpu_weight_only import FbgemmInt8, int8_available

if TYPE_CHECKING:
    from dyntree.common.drafter import TargetInfo
    from dyntree.common.quant import QuantLinear, WeightKernel

__all__ = [
    "DTYPES",
    "tokenizer_sha256",
    "HydraConfig",
    "HydraHeads",
    "HydraMismatchError",
    "PrefixAttention",
    "PrefixKV",
    "TargetIdentity",
    "default_prefix_heads",
]

FORMAT_VERSION = 1
#: The weight dtypes a checkpoint may store, by their names in ``config.json``.
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: The prefix layer's SwiGLU MLP width, in multiples of the hidden size.
PREFIX_MLP_RATIO = 3
#: RoPE base of the prefix layer.
PREFIX_ROPE_THETA = 10000.0


def tokenizer_sha256(tokenizer: Any) -> str:
    """sha256 of a tokenizer's vocabulary (``get_vocab()``: token -> id, sorted by id), independent
    of file layout: heads trained for one tokenizer are refused with another of the same size."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


class HydraMismatchError(ValueError):
    """A checkpoint does not fit the target (or is malformed); the message names the field."""


@dataclass(frozen=True)
class TargetIdentity:
    """What a set of heads was trained against; checked on load.

    Attributes:
        name: a human-readable model name (informational; not compared).
        hidden_size: width of the target's last hidden state.
        vocab_size: rows of the target's LM head.
        tokenizer_sha256: hash of the tokenizer's vocabulary (token -> id), so heads trained for
            one tokenizer are not used with another of the same size.
    """

    name: str
    hidden_size: int
    vocab_size: int
    tokenizer_sha256: str

    @classmethod
    def of(cls, target: "TargetInfo") -> "TargetIdentity":
        """The identity of a target as an engine describes it."""
        return cls(target.name, target.hidden_size, target.vocab_size, target.tokenizer_sha256)


@dataclass(frozen=True)
class HydraConfig:
    """Architecture and provenance of a set of heads (``config.json``).

    Attributes:
        num_heads: K, the number of heads (= the deepest draft).
        num_layers: residual layers per head.
        layer_width: inner width of each residual layer as a multiple of ``hidden_size``: 1 is
            ``z + silu(W z)`` (Medusa's block), ``m > 1`` is ``z + W_down silu(W_up z)`` with
            ``W_up`` of ``m * hidden_size`` rows (absent in older checkpoints: 1).
        hidden_size: d, the target's hidden size.
        independent: True for the Medusa-style ablation (no drafted tokens as input).
        prefix_attention: True for Hydra++ prefix attention (one decoder layer over the target's
            hidden states of the committed prefix feeds the heads); absent in older checkpoints.
        prefix_heads: attention heads of the prefix layer (``hidden_size`` divisible by it, even
            head size); 0 exactly when ``prefix_attention`` is False.
        reduced_vocab: size of the reduced output vocabulary, or 0 for the full LM head.
        target: the :class:`TargetIdentity` the heads were trained on.
        dtype: the dtype the weights are stored in.
        training: free-form provenance (command, data, steps, losses); never interpreted.
    """

    num_heads: int
    num_layers: int
    hidden_size: int
    target: TargetIdentity
    independent: bool = False
    reduced_vocab: int = 0
    dtype: str = "float32"
    training: dict[str, Any] = field(default_factory=dict)
    prefix_attention: bool = False
    prefix_heads: int = 0
    layer_width: int = 1

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_layers", "hidden_size", "layer_width"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise HydraMismatchError(f"HydraConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.reduced_vocab < 0 or self.reduced_vocab > self.target.vocab_size:
            raise HydraMismatchError(
                f"HydraConfig.reduced_vocab={self.reduced_vocab} must lie in [0, vocab_size="
                f"{self.target.vocab_size}]"
            )
        if self.hidden_size != self.target.hidden_size:
            raise HydraMismatchError(
                f"HydraConfig.hidden_size={self.hidden_size} differs from target.hidden_size="
                f"{self.target.hidden_size}"
            )
        if self.dtype not in DTYPES:
            raise HydraMismatchError(f"HydraConfig.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        self._check_prefix()

    def _check_prefix(self) -> None:
        if not isinstance(self.prefix_attention, bool):
            raise HydraMismatchError(f"HydraConfig.prefix_attention must be a bool, got {self.prefix_attention!r}")
        if not self.prefix_attention:
            if self.prefix_heads != 0:
                raise HydraMismatchError(
                    f"HydraConfig.prefix_heads={self.prefix_heads!r} must be 0 when prefix_attention is False"
                )
            return
        if not isinstance(self.prefix_heads, int) or self.prefix_heads < 1 or self.hidden_size % self.prefix_heads:
            raise HydraMismatchError(
                f"HydraConfig.prefix_heads={self.prefix_heads!r} must be a positive divisor of "
                f"hidden_size={self.hidden_size}"
            )
        if (self.hidden_size // self.prefix_heads) % 2:
            raise HydraMismatchError(
                f"HydraConfig.prefix_heads={self.prefix_heads} gives an odd head size "
                f"{self.hidden_size // self.prefix_heads}; RoPE needs an even one"
            )

    def to_json(self) -> dict[str, Any]:
        return {"format": "dyntree-hydra", "format_version": FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "HydraConfig":
        if data.get("format") != "dyntree-hydra":
            raise HydraMismatchError("config.json is not a dyntree Hydra checkpoint (field 'format')")
        if data.get("format_version") != FORMAT_VERSION:
            raise HydraMismatchError(
                f"config.json format_version={data.get('format_version')!r}; this dyntree reads {FORMAT_VERSION}"
            )
        fields = {k: v for k, v in data.items() if k not in ("format", "format_version")}
        try:
            fields["target"] = TargetIdentity(**fields["target"])
            return cls(**fields)
        except (KeyError, TypeError) as exc:
            raise HydraMismatchError(f"config.json is malformed: {exc}") from exc


def default_prefix_heads(hidden_size: int) -> int:
    """Prefix-layer attention heads for a hidden size: heads of size 64 when it divides, else one."""
    return hidden_size // 64 if hidden_size % 64 == 0 else 1


@dataclass(frozen=True)
class PrefixKV:
    """The prefix layer's KV cache for a batch of sequences: every prefix position processed so far.

    Attributes:
        keys: ``[B, H, L, head_dim]``, already rotated (RoPE) at their absolute positions.
        values: ``[B, H, L, head_dim]``.
        mask: ``[B, L]`` bool, True where a slot holds a real position (a batch of sequences of
            different lengths is padded to a common ``L``; slots are in position order);
            ``None``: every slot is real (a lone sequence, every decoding step: no mask to grow).
        store: the storage a single-row cache's ``keys`` and ``values`` are views of (see
            :meth:`extend`); ``None`` for a batch or a cache not made by :meth:`extend`.
    """

    keys: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor | None = None
    store: KVStore | None = field(default=None, repr=False, compare=False)

    @property
    def length(self) -> int:
        """Slots per row (real positions of a compact single row)."""
        return self.keys.shape[2]

    def slots(self) -> torch.Tensor:
        """``[B, L]`` bool: the mask, made when there is none."""
        if self.mask is not None:
            return self.mask
        return torch.ones(self.keys.shape[0], self.length, dtype=torch.bool, device=self.keys.device)

    def row(self, b: int) -> "PrefixKV":
        """Row ``b`` alone, padding dropped: a compact ``[1, H, L_b, head_dim]`` cache (``self``
        when that is what it already is: no copy of a lone sequence's cache every step)."""
        if self.mask is None:
            return self if self.keys.shape[0] == 1 else PrefixKV(self.keys[b : b + 1], self.values[b : b + 1])
        m = self.mask[b]
        if bool(m.all()):
            return PrefixKV(self.keys[b : b + 1], self.values[b : b + 1], None,
                            self.store if self.keys.shape[0] == 1 else None)
        return PrefixKV(self.keys[b : b + 1, :, m], self.values[b : b + 1, :, m], self.mask[b : b + 1, m])

    def extend(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None) -> "PrefixKV":
        """This cache followed by ``T`` new slots (``keys`` / ``values`` ``[B, H, T, head_dim]``,
        ``valid`` ``[B, T]``, ``None``: all real). A single row grows in place, in storage with room
        to spare (the newest cache of a storage only: an older one that is extended again, a
        branch, is copied first), so a decoding step does not copy the whole cache; a batch of rows
        is concatenated."""
        mask = None if self.mask is None and valid is None else torch.cat(
            [self.slots(), valid if valid is not None else torch.ones(keys.shape[0], keys.shape[2], dtype=torch.bool,
                                                                        device=keys.device)], dim=1)
        if keys.shape[0] != 1:
            return PrefixKV(torch.cat([self.keys, keys], dim=2), torch.cat([self.values, values], dim=2), mask)
        total = self.length + keys.shape[2]
        k, v, store = append_kv(self.keys if self.length else None, self.values if self.length else None, keys,
                                values, self.store, max(total, 64 - total))
        return PrefixKV(k, v, mask, store)

    @staticmethod
    def stack(rows: Sequence["PrefixKV"]) -> "PrefixKV":
        """Batch single-row caches, padded at the end to the longest (padding masked out)."""
        if len(rows) == 1:
            return rows[0]
        width = max(r.length for r in rows)

        def pad(x: torch.Tensor) -> torch.Tensor:
            return F.pad(x, (0, 0, 0, width - x.shape[2]))

        if all(r.mask is None and r.length == width for r in rows):
            return PrefixKV(torch.cat([r.keys for r in rows]), torch.cat([r.values for r in rows]))
        return PrefixKV(
            torch.cat([pad(r.keys) for r in rows]),
            torch.cat([pad(r.values) for r in rows]),
            torch.cat([F.pad(r.slots(), (0, width - r.length), value=False) for r in rows]),
        )


class PrefixAttention(nn.Module):
    """Hydra++'s prefix layer: one pre-norm decoder layer (RMSNorm, causal multi-head attention
    with RoPE, SwiGLU MLP, residuals) over a sequence of target hidden states.

    ``o_proj`` and ``down`` start at zero, so the untrained layer is the identity.
    """

    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self._tables: dict[torch.device, torch.Tensor] = {}  # RoPE cos / signed sin per position, per device
        self.attn_norm = nn.RMSNorm(hidden, eps=1e-6)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden, eps=1e-6)
        self.gate_up = nn.Linear(hidden, 2 * PREFIX_MLP_RATIO * hidden, bias=False)
        self.down = nn.Linear(PREFIX_MLP_RATIO * hidden, hidden, bias=False)
        with torch.no_grad():
            self.o_proj.weight.zero_()
            self.down.weight.zero_()

    def empty_kv(self, batch: int, like: torch.Tensor) -> PrefixKV:
        """A cache of ``batch`` rows holding no position (dtype and device of ``like``)."""
        kv = like.new_zeros(batch, self.num_heads, 0, self.head_dim)
        return PrefixKV(kv, kv)

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's ``cos`` and signed ``sin`` (``-sin`` on the first half, ``sin`` on the second)
        ``[B, 1, T, head_dim]`` at ``positions`` ``[B, T]``, in fp32 whatever the weights' dtype (a
        half-precision frequency would drift at long positions): rows of a table per device, made
        for twice the positions needed whenever a position lies beyond it."""
        table = self._tables.get(positions.device)
        top = int(positions.max()) + 1 if positions.numel() else 0
        if table is None or table.shape[0] < top:  # not a buffer: casting the module must not round it
            half = self.head_dim // 2
            inv_freq = PREFIX_ROPE_THETA ** -(torch.arange(half, device=positions.device, dtype=torch.float32) / half)
            angles = torch.arange(max(2 * top, 1024), device=positions.device).float()[:, None] * inv_freq
            table = torch.stack([torch.cat([angles, angles], -1).cos(), torch.cat([-angles.sin(), angles.sin()], -1)], 1)
            self._tables[positions.device] = table  # [P, 2, head_dim]
        cos, sin = table[positions[:, None]].unbind(-2)
        return cos, sin

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE: ``x`` ``[..., B, H, T, head_dim]`` (queries and keys at once) rotated by the angles
        of :meth:`_angles`: ``x cos + (x_2, x_1) sin`` with the halves swapped."""
        xf = x.float()
        swapped = xf.unflatten(-1, (2, self.head_dim // 2)).flip(-2).flatten(-2)
        return (xf * cos + swapped * sin).to(x.dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        past: PrefixKV | None = None,
        valid: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, PrefixKV]:
        """Run the layer over new positions that follow ``past`` (see :meth:`HydraHeads.prefix_forward`)."""
        b, t, d = hidden.shape
        past = past if past is not None else self.empty_kv(b, hidden)
        qkv = self.qkv(self.attn_norm(hidden)).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        cos, sin = self._angles(positions)
        (q, k), v = self._rotate(qkv[:2], cos, sin), qkv[2]
        kv = past.extend(k, v, valid)
        if t == 1 and kv.mask is None:
            # one new position that sees every slot (a decoding step): no mask. Torch's fused kernel,
            # not plain products: a half-precision matmul of a new shape (the cache grows every step)
            # builds a new oneDNN primitive, ~1 ms on a CPU (docs/measurements.md)
            attn = F.scaled_dot_product_attention(q, kv.keys, kv.values)
        else:
            causal = torch.ones(t, t, dtype=torch.bool, device=hidden.device).tril()
            see = torch.cat([past.slots()[:, None, :].expand(b, t, past.length), causal.expand(b, t, t)], dim=-1)
            attn = F.scaled_dot_product_attention(q, kv.keys, kv.values, attn_mask=see[:, None])
        h = hidden + self.o_proj(attn.transpose(1, 2).reshape(b, t, d))
        gate, up = self.gate_up(self.mlp_norm(h)).chunk(2, dim=-1)
        out = h + self.down(F.silu(gate) * up)
        return out, kv


class _WideLayer(nn.Module):
    """A residual layer's branch of inner width ``width * hidden``: ``W_down silu(W_up z)``."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, width * hidden)
        self.down = nn.Linear(width * hidden, hidden, bias=False)
        with torch.no_grad():  # the branch starts at zero, like the width-1 layer
            self.down.weight.zero_()

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(z)))


class _Head(nn.Module):
    """One head: an input projection from the concatenated inputs, then residual SiLU layers
    (``z + silu(W z)`` at width 1, ``z + W_down silu(W_up z)`` when wider)."""

    def __init__(self, num_inputs: int, hidden: int, num_layers: int, width: int = 1) -> None:
        super().__init__()
        self.width = width
        self.proj = nn.Linear(num_inputs * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(
            nn.Linear(hidden, hidden) if width == 1 else _WideLayer(hidden, width) for _ in range(num_layers)
        )
        with torch.no_grad():  # start as "the target's own next-token head": z = h_t
            self.proj.weight.zero_()
            self.proj.weight[:, :hidden].copy_(torch.eye(hidden))
            self.proj.weight[:, hidden:].normal_(0.0, 0.02 / num_inputs)
            if width == 1:
                for layer in self.layers:
                    layer.weight.zero_()
                    layer.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.proj(x)
        for layer in self.layers:
            z = z + (F.silu(layer(z)) if self.width == 1 else layer(z))
        return z


class HydraHeads(nn.Module):
    """K draft heads over a frozen target embedding table and LM head.

    ``embed`` and ``lm_head`` are the target's weights (``[vocab, d]``); they are buffers, never
    trained and never saved. ``token_map`` (``[V]`` int64, reduced vocabulary only) maps reduced
    ids to full ids; it is saved with the heads. With ``config.prefix_attention`` the heads also
    own ``prefix`` (:class:`PrefixAttention`, else ``None``), and the ``hidden`` the heads read is
    the output of :meth:`prefix_forward` at the newest position rather than the raw ``h_t``.
    """

    def __init__(
        self,
        config: HydraConfig,
        embed: torch.Tensor,
        lm_head: torch.Tensor,
        token_map: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        d, vocab = config.hidden_size, config.target.vocab_size
        for name, w in (("embedding", embed), ("lm_head", lm_head)):
            if w.dim() != 2 or w.shape[1] != d:
                raise HydraMismatchError(
                    f"target {name} has shape {tuple(w.shape)}; hidden size must be {d} (heads' hidden_size)"
                )
            if w.shape[0] != vocab:
                raise HydraMismatchError(
                    f"target {name} has {w.shape[0]} rows; the heads expect vocabulary {vocab}"
                )
        if config.reduced_vocab:
            if token_map is None or token_map.shape != (config.reduced_vocab,):
                raise HydraMismatchError(
                    f"reduced vocabulary {config.reduced_vocab} needs a token_map of that length, got "
                    f"{None if token_map is None else tuple(token_map.shape)}"
                )
            token_map = token_map.to(torch.int64)
            if int(token_map.min()) < 0 or int(token_map.max()) >= vocab:
                raise HydraMismatchError(f"token_map holds ids outside the vocabulary [0, {vocab})")
            if torch.unique(token_map).numel() != token_map.numel():
                raise HydraMismatchError("token_map holds duplicate token ids")
        elif token_map is not None:
            raise HydraMismatchError("token_map given but config.reduced_vocab is 0 (full vocabulary)")
        self.config = config
        self.heads = nn.ModuleList(
            _Head(2 if config.independent else k + 1, d, config.num_layers, config.layer_width)
            for k in range(1, config.num_heads + 1)
        )
        self.prefix = PrefixAttention(d, config.prefix_heads) if config.prefix_attention else None
        self.register_buffer("embed", embed.detach(), persistent=False)
        rows = lm_head.detach()[token_map] if token_map is not None else lm_head.detach()
        self.register_buffer("out_weight", rows.contiguous(), persistent=False)
        self.register_buffer(
            "token_map",
            token_map if token_map is not None else torch.empty(0, dtype=torch.int64),
            persistent=True,
        )
        #: the heads' linears' CPU routing (:mod:`dyntree.kernels.cpu_linear`): the engine's dispatch
        #: when it hands one over (``Drafter.route_linears``), else stock ``F.linear``
        self.router = LinearRouter()
        install(self, self.router)
        self._out_int8: nn.Module | None = None

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def use_int8(self, kernel: "WeightKernel | None" = None) -> "HydraHeads":
        """Run the output rows' product, the heads' largest (``vocab' x hidden``), on int8 weights:
        a :class:`~dyntree.common.quant.QuantLinear` (one scale per output row) through a kernel.
        fp32 heads: FBGEMM's int8 GEMM (:class:`~dyntree.kernels.cpu_weight_only.FbgemmInt8`, inputs
        quantized per call). Half-precision heads need ``kernel`` (the engine's CPU weight kernel,
        :func:`~dyntree.kernels.cpu_weight_only.cpu_weight_kernel`); their output rows take FBGEMM too where torch
        has it (faster at the row counts of a step), else the kernel. With ``kernel`` the heads'
        own linears and the prefix layer's also keep int8 weights and take their inputs rounded to
        the kernel's compute dtype, not quantized (quantized inputs cost tau; weight-only barely
        moves it). On a CPU the heads' calls are bound by the bytes of weight they read, so
        halving them pays at the row counts a step uses. Half-precision heads take the int8 copies
        only for calls of at most :data:`INT8_MAX_ROWS` rows (the dense weights stay for larger
        ones); linears the kernel does not serve stay as they are. Measurements:
        ``docs/measurements.md`` (Hydra heads).
        Returns ``self``."""
        fbgemm = FbgemmInt8() if self.out_weight.device.type == "cpu" and int8_available() else None
        if self.out_weight.dtype == torch.float32:
            if fbgemm is None:
                raise RuntimeError("int8 output rows of fp32 heads need torch's FBGEMM engine (an x86 CPU build of torch)")
            self._out_int8 = _int8_rows(self.out_weight, fbgemm)
        elif kernel is None:
            raise ValueError(f"int8 output rows of {str(self.out_weight.dtype).removeprefix('torch.')} heads need a "
                             "weight-only kernel")
        else:
            self._out_int8 = _Int8Rows(functools.partial(self.router.linear, weight=self.out_weight),
                                       _int8_rows(self.out_weight, fbgemm or kernel), compute=True)
        if kernel is not None:
            _int8_linears(self, kernel)
        return self

    @property
    def int8(self) -> bool:
        return self._out_int8 is not None

    @property
    def out_vocab(self) -> int:
        return self.out_weight.shape[0]

    def to_full_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Map output ids (reduced when a reduced vocabulary is used) to full vocabulary ids."""
        return self.token_map[ids] if self.config.reduced_vocab else ids

    def prefix_forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        past: PrefixKV | None = None,
        valid: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, PrefixKV]:
        """The prefix layer over new positions of ``B`` sequences, causally, after their cached ones.

        Args:
            hidden: ``[B, T, d]`` target hidden states of the new positions, in position order.
            positions: ``[B, T]`` their absolute positions (the RoPE angles).
            past: the cache of every earlier position of each sequence (``None``: none yet).
            valid: ``[B, T]`` bool; False marks padding at the end of a shorter row (its output
                is meaningless and its slot is masked in the returned cache). Default: all real.
        Returns:
            The outputs ``[B, T, d]`` (the heads' input at each position) and the cache extended
            by the new positions. Running a sequence in chunks gives the outputs of one full pass.
        """
        if self.prefix is None:
            raise HydraMismatchError("prefix_forward needs heads with HydraConfig.prefix_attention=True")
        d = self.config.hidden_size
        if hidden.dim() != 3 or hidden.shape[2] != d:
            raise HydraMismatchError(f"hidden has shape {tuple(hidden.shape)}; expected [B, T, hidden_size={d}]")
        if positions.shape != hidden.shape[:2]:
            raise ValueError(f"positions must have shape {tuple(hidden.shape[:2])}, got {tuple(positions.shape)}")
        if valid is not None and valid.shape != hidden.shape[:2]:
            raise ValueError(f"valid must have shape {tuple(hidden.shape[:2])}, got {tuple(valid.shape)}")
        if past is not None and past.keys.shape[0] != hidden.shape[0]:
            raise ValueError(f"past holds {past.keys.shape[0]} rows for a batch of {hidden.shape[0]}")
        return self.prefix(hidden.to(self.out_weight.dtype), positions, past, valid)

    def head_logits(self, k: int, hidden: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
        """Logits of head ``k`` (1-based) over the output vocabulary.

        Args:
            hidden: ``[N, d]`` target hidden states ``h_t`` (with prefix attention: the prefix
                layer's outputs at those positions).
            path: ``[N, k]`` full-vocabulary ids: the root followed by the ``k-1`` drafted tokens.
        Returns:
            ``[N, out_vocab]`` logits: fp32 from FBGEMM's int8 rows, else in the heads' dtype.
        """
        if not 1 <= k <= self.num_heads:
            raise ValueError(f"head index k={k} outside 1..{self.num_heads}")
        if hidden.dim() != 2 or hidden.shape[1] != self.config.hidden_size:
            raise HydraMismatchError(
                f"hidden has shape {tuple(hidden.shape)}; expected [N, hidden_size={self.config.hidden_size}]"
            )
        if path.dim() != 2 or path.shape != (hidden.shape[0], k):
            raise ValueError(f"path for head {k} must have shape [{hidden.shape[0]}, {k}], got {tuple(path.shape)}")
        tokens = path[:, :1] if self.config.independent else path
        dtype = self.out_weight.dtype
        x = torch.cat([_cast(hidden, dtype), _cast(self.embed[tokens].flatten(1), dtype)], dim=1)
        z = self.heads[k - 1](x)
        return self._out_int8(z) if self._out_int8 is not None else self.router.linear(z, self.out_weight)

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """All heads, teacher-forced: ``tokens[:, j]`` is ``x_{t+1+j}`` (root first), ``[N, K]``.

        Returns ``[N, K, out_vocab]``; row ``k-1`` is head ``k``'s prediction of ``x_{t+k+1}``.
        """
        if tokens.dim() != 2 or tokens.shape[1] < self.num_heads:
            raise ValueError(f"tokens must have shape [N, >= {self.num_heads}], got {tuple(tokens.shape)}")
        return torch.stack(
            [self.head_logits(k, hidden, tokens[:, :k]) for k in range(1, self.num_heads + 1)], dim=1
        )


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype`` (itself when it already is: no dispatcher call)."""
    return x if x.dtype == dtype else x.to(dtype)


#: The most rows a call of an int8 weight-only linear takes; larger ones (the prefix layer catching
#: up on a prompt's positions) stay on the dense weight: with bf16 compute emulated on a CPU without
#: native bf16, torch's int8 op loses to fp32 GEMM at a few dozen rows and more.
INT8_MAX_ROWS = 16


class _Int8Rows(nn.Module):
    """A linear with an int8 copy (``small``, a kernel's :class:`~dyntree.common.quant.QuantLinear`)
    for calls of at most :data:`INT8_MAX_ROWS` rows; ``dense`` (a linear, or the dense product as
    a function) takes the larger calls. ``compute``: the int8 calls return the kernel's compute
    dtype (fp32 logits from FBGEMM, not rounded to the heads' dtype and widened again)."""

    def __init__(self, dense: "nn.Module | Callable[[torch.Tensor], torch.Tensor]", small: "QuantLinear",
                 compute: bool = False) -> None:
        super().__init__()
        self.dense, self.small, self.compute = dense, small, compute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() > INT8_MAX_ROWS * x.shape[-1]:
            return self.dense(x)
        if not self.compute or x.dim() != 2:
            return self.small(x)
        assert self.small.kernel is not None
        return self.small.kernel_forward(_cast(x, self.small.kernel.compute_dtype(x.dtype)))


def _int8_rows(weight: torch.Tensor, kernel: "WeightKernel") -> "QuantLinear":
    """``x @ weight.T`` on int8 codes (one symmetric scale per output row) held by ``kernel`` only."""
    from dyntree.common.quant import QSpec, QuantLinear

    rows = QuantLinear.from_weight(weight, None, QSpec(weight_bits=8, group_size=None), kernel=kernel)
    if rows.kernel is None:
        raise ValueError(f"{type(kernel).__name__} does not serve the heads' output rows")
    rows.release_codes()
    return rows


def _int8_linears(module: nn.Module, kernel: "WeightKernel") -> None:
    """Give every ``nn.Linear`` under ``module`` that ``kernel`` serves a weight-only int8 copy
    (:class:`~dyntree.common.quant.QuantLinear`, one scale per output row) for few-row calls."""
    from dyntree.common.quant import QSpec, QuantLinear

    spec = QSpec(weight_bits=8, group_size=None)
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            quantized = QuantLinear.from_linear(child, spec, kernel=kernel)
            if quantized.kernel is not None:
                quantized.release_codes()
                setattr(module, name, _Int8Rows(child, quantized))
        elif not isinstance(child, _Int8Rows):
            _int8_linears(child, kernel)
