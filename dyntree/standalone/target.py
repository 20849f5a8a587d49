"""What drafters borrow from a Hugging Face target: :func:`hf_target` fills the engine-neutral
:class:`~dyntree.common.drafter.TargetInfo`, and :func:`resolve_hf_drafter` builds a drafter from a
spec with it (through :func:`~dyntree.common.drafters.make_engine_drafter`, as every engine does)."""

from __future__ import annotations

from typing import Any

from dyntree.common.drafter import Drafter, TargetInfo
from dyntree.common.drafters import make_engine_drafter
from dyntree.kernels.cpu_weight_only import cpu_weight_kernel

__all__ = ["hf_target", "make_hf_drafter", "resolve_hf_drafter"]


def hf_target(model: Any, tokenizer: Any, name: str | None = None) -> TargetInfo:
    """The target's name, hidden size, frozen embedding and LM-head weights, tokenizer hash, and
    on a CPU torch's weight-only int8 matmul for the drafter's own weights."""
    return TargetInfo.from_model(model, tokenizer, name or getattr(model.config, "_name_or_path", "") or type(model).__name__,
                                 weight_kernel=cpu_weight_kernel(next(model.parameters()).device))


def resolve_hf_drafter(spec: str, model: Any, tokenizer: Any) -> tuple[Drafter, str]:
    """The drafter for ``spec`` over this target and the spec it resolved to (``auto``: ``hydra``
    when the shipped heads fit the target, else ``ngram``)."""
    return make_engine_drafter(spec, lambda: hf_target(model, tokenizer))


def make_hf_drafter(spec: str, model: Any, tokenizer: Any) -> Drafter:
    """The drafter of :func:`resolve_hf_drafter`."""
    return resolve_hf_drafter(spec, model, tokenizer)[0]
