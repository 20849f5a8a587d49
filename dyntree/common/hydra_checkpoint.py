"""Hydra checkpoints: a directory with ``model.safetensors`` (the heads' weights and token map),
``config.json`` (:class:`~dyntree.common.hydra.HydraConfig` with the target's identity) and,
optionally, ``acceptance.json`` (the heads' measured acceptance, the tree builder's calibration).
Loading refuses heads trained for another target, naming the dimension that differs.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from dyntree.common.calibration import AcceptanceTable
from dyntree.common.hydra import DTYPES, HydraConfig, HydraHeads, HydraMismatchError, TargetIdentity

__all__ = ["ACCEPTANCE_FILE", "save_heads", "read_config", "check_target", "load_heads", "load_acceptance"]

#: Optional file of a checkpoint directory: the heads' measured acceptance per depth, rank and
#: confidence (:class:`~dyntree.common.calibration.AcceptanceTable`), the tree builder's calibration.
ACCEPTANCE_FILE = "acceptance.json"


def save_heads(heads: HydraHeads, out_dir: str | Path, dtype: torch.dtype = torch.float16) -> Path:
    """Write ``model.safetensors`` + ``config.json`` to ``out_dir`` (weights cast to ``dtype``)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype_name = {v: k for k, v in DTYPES.items()}[dtype]
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


def load_acceptance(ckpt_dir: str | Path) -> AcceptanceTable | None:
    """The checkpoint's measured :class:`AcceptanceTable` (``None`` when it has none); refuses a
    table whose depths are not the heads'."""
    path = Path(ckpt_dir) / ACCEPTANCE_FILE
    if not path.is_file():
        return None
    try:
        table = AcceptanceTable.load(path)
    except ValueError as exc:
        raise HydraMismatchError(str(exc)) from None
    heads = read_config(ckpt_dir).num_heads
    if table.acceptance.shape[0] != heads:
        raise HydraMismatchError(f"{path}: the table has {table.acceptance.shape[0]} depths, the heads {heads}")
    return table
