"""Hydra draft heads: the trained, sequentially dependent drafter, and its checkpoint format.

Head ``k`` (1-based) reads the target's last-layer hidden state ``h_t`` (after the final norm:
the LM-head input at the committed token before the root) together with the input embeddings of
the ``k`` tokens already on the path (root ``x_{t+1}``, then the tokens heads ``1..k-1`` chose)
and predicts token ``x_{t+k+1}``::

    z = W_in[k] @ concat(h_t, emb(x_{t+1}), ..., emb(x_{t+k}))      # (k+1)*d -> d
    z = z + SiLU(W_l z)   for each of the head's residual layers
    logits = lm_head_rows @ z                                         # frozen target LM head

The independent ablation (Medusa-style, ``independent=True``) cuts the sequential input: every
head sees only ``h_t`` and the committed root's embedding, never a drafted token.

The output goes through the target's frozen LM head, either in full or restricted to a reduced
vocabulary (the ``V`` most frequent tokens of the training data, ``token_map[j]`` = full id of
reduced id ``j``). The target's embedding and LM-head weights are borrowed at load time and never
stored: a checkpoint directory holds ``model.safetensors`` (the head weights and the token map) and
``config.json`` (:class:`HydraConfig`, including the identity of the target it was trained on).
Loading checks that identity and refuses a mismatch naming the dimension.

Torch only: this module never imports transformers.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "HydraConfig",
    "HydraHeads",
    "HydraMismatchError",
    "TargetIdentity",
    "load_heads",
    "save_heads",
]

FORMAT_VERSION = 1
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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


@dataclass(frozen=True)
class HydraConfig:
    """Architecture and provenance of a set of heads (``config.json``).

    Attributes:
        num_heads: K, the number of heads (= the deepest draft).
        num_layers: residual layers per head.
        hidden_size: d, the target's hidden size.
        independent: True for the Medusa-style ablation (no drafted tokens as input).
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

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_layers", "hidden_size"):
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
        if self.dtype not in _DTYPES:
            raise HydraMismatchError(f"HydraConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

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


class _Head(nn.Module):
    """One head: an input projection from the concatenated inputs, then residual SiLU layers."""

    def __init__(self, num_inputs: int, hidden: int, num_layers: int) -> None:
        super().__init__()
        self.proj = nn.Linear(num_inputs * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(num_layers))
        with torch.no_grad():  # start as "the target's own next-token head": z = h_t
            self.proj.weight.zero_()
            self.proj.weight[:, :hidden].copy_(torch.eye(hidden))
            self.proj.weight[:, hidden:].normal_(0.0, 0.02 / num_inputs)
            for layer in self.layers:
                layer.weight.zero_()
                layer.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.proj(x)
        for layer in self.layers:
            z = z + F.silu(layer(z))
        return z


class HydraHeads(nn.Module):
    """K draft heads over a frozen target embedding table and LM head.

    ``embed`` and ``lm_head`` are the target's weights (``[vocab, d]``); they are buffers, never
    trained and never saved. ``token_map`` (``[V]`` int64, reduced vocabulary only) maps reduced
    ids to full ids; it is saved with the heads.
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
            _Head(2 if config.independent else k + 1, d, config.num_layers) for k in range(1, config.num_heads + 1)
        )
        self.register_buffer("embed", embed.detach(), persistent=False)
        rows = lm_head.detach()[token_map] if token_map is not None else lm_head.detach()
        self.register_buffer("out_weight", rows.contiguous(), persistent=False)
        self.register_buffer(
            "token_map",
            token_map if token_map is not None else torch.empty(0, dtype=torch.int64),
            persistent=True,
        )

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @property
    def out_vocab(self) -> int:
        return self.out_weight.shape[0]

    def to_full_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Map output ids (reduced when a reduced vocabulary is used) to full vocabulary ids."""
        return self.token_map[ids] if self.config.reduced_vocab else ids

    def head_logits(self, k: int, hidden: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
        """Logits of head ``k`` (1-based) over the output vocabulary.

        Args:
            hidden: ``[N, d]`` target hidden states ``h_t``.
            path: ``[N, k]`` full-vocabulary ids: the root followed by the ``k-1`` drafted tokens.
        Returns:
            ``[N, out_vocab]`` logits.
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
        emb = self.embed[tokens].to(hidden.dtype)  # [N, k, d]
        x = torch.cat([hidden.unsqueeze(1), emb], dim=1).flatten(1)
        z = self.heads[k - 1](x.to(self.out_weight.dtype))
        return z @ self.out_weight.T

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """All heads, teacher-forced: ``tokens[:, j]`` is ``x_{t+1+j}`` (root first), ``[N, K]``.

        Returns ``[N, K, out_vocab]``; row ``k-1`` is head ``k``'s prediction of ``x_{t+k+1}``.
        """
        if tokens.dim() != 2 or tokens.shape[1] < self.num_heads:
            raise ValueError(f"tokens must have shape [N, >= {self.num_heads}], got {tuple(tokens.shape)}")
        return torch.stack(
            [self.head_logits(k, hidden, tokens[:, :k]) for k in range(1, self.num_heads + 1)], dim=1
        )


def save_heads(heads: HydraHeads, out_dir: str | Path, dtype: torch.dtype = torch.float16) -> Path:
    """Write ``model.safetensors`` + ``config.json`` to ``out_dir`` (weights cast to ``dtype``)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype_name = {v: k for k, v in _DTYPES.items()}[dtype]
    tensors = {k: v.detach().to("cpu") for k, v in heads.state_dict().items()}
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"))
    cfg = HydraConfig(**{**asdict(heads.config), "target": heads.config.target, "dtype": dtype_name})
    (out / "config.json").write_text(json.dumps(cfg.to_json(), indent=2) + "\n")
    return out


def read_config(ckpt_dir: str | Path) -> HydraConfig:
    path = Path(ckpt_dir) / "config.json"
    if not path.is_file():
        raise HydraMismatchError(f"{path} does not exist: not a Hydra checkpoint directory")
    return HydraConfig.from_json(json.loads(path.read_text()))


def check_target(config: HydraConfig, target: TargetIdentity) -> None:
    """Raise :class:`HydraMismatchError` naming the first dimension where heads and target differ."""
    mine = config.target
    if mine.hidden_size != target.hidden_size:
        raise HydraMismatchError(
            f"hidden size mismatch: heads were trained for hidden size {mine.hidden_size} "
            f"({mine.name}), the target has {target.hidden_size} ({target.name})"
        )
    if mine.vocab_size != target.vocab_size:
        raise HydraMismatchError(
            f"vocabulary mismatch: heads were trained for vocabulary {mine.vocab_size} "
            f"({mine.name}), the target has {target.vocab_size} ({target.name})"
        )
    if mine.tokenizer_sha256 != target.tokenizer_sha256:
        raise HydraMismatchError(
            f"tokenizer mismatch: heads were trained with tokenizer {mine.tokenizer_sha256[:12]} "
            f"({mine.name}), the target's tokenizer is {target.tokenizer_sha256[:12]} ({target.name})"
        )


def load_heads(
    ckpt_dir: str | Path,
    target: TargetIdentity,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> HydraHeads:
    """Load heads from ``ckpt_dir`` for ``target`` (refusing a mismatch), in ``dtype`` on ``device``."""
    from safetensors.torch import load_file

    config = read_config(ckpt_dir)
    check_target(config, target)
    weights_path = Path(ckpt_dir) / "model.safetensors"
    if not weights_path.is_file():
        raise HydraMismatchError(f"{weights_path} does not exist")
    state = load_file(str(weights_path))
    token_map = state.get("token_map")
    heads = HydraHeads(
        config,
        embed.to(device=device, dtype=dtype),
        lm_head.to(device=device, dtype=dtype),
        token_map if config.reduced_vocab else None,
    )
    missing, unexpected = heads.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise HydraMismatchError(
            f"model.safetensors does not match config.json: missing {missing}, unexpected {unexpected}"
        )
    return heads.to(device=device, dtype=dtype).eval()
