"""The engine's attention as a transformers attention function, and the scope that switches a
model to it.

``"dyntree"`` runs :func:`dyntree.common.attention.attend` (the calibrated choice among three
K/V-copy-free implementations; see that module) on the additive 4-D masks the engine passes;
anything it does not handle (soft-capping, sliding windows, attention sinks, dropout, no mask)
goes to transformers' own ``sdpa``. ``"dyntree_grouped"`` is always the two-matmul form, which
distillation-data generation uses for its batched greedy decoding.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import eager_mask

from dyntree.common.attention import AttentionDispatch, attend, grouped_matmul

__all__ = ["ENGINE", "GROUPED", "attention_scope", "grouped_attention"]

#: The registered names: the engine's calibrated routing, and always the two-matmul form.
ENGINE, GROUPED = "dyntree", "dyntree_grouped"

_UNHANDLED = ("softcap", "sliding_window", "s_aux")


def _engine_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    plain = (attention_mask is not None and attention_mask.dtype != torch.bool and dropout == 0.0
             and scaling is not None and not any(kwargs.get(k) is not None for k in _UNHANDLED))
    if not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    return attend(query, key, value, attention_mask, scaling).transpose(1, 2).contiguous(), None


def grouped_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                      **_: Any) -> tuple[torch.Tensor, None]:
    """Eager attention without repeating K/V per query group (Hugging Face's ``repeat_kv`` copies the
    whole cache every step). Batched greedy generation with SmolLM2 on a 2-core AVX512-BF16 CPU
    (bf16, batch 64): 295-333 tokens/s against 232-256 with ``eager`` and 178-194 with ``sdpa``."""
    return grouped_matmul(query, key, value, attention_mask, scaling).transpose(1, 2).contiguous(), None


AttentionInterface.register(ENGINE, _engine_attention)
AttentionMaskInterface.register(ENGINE, eager_mask)
AttentionInterface.register(GROUPED, grouped_attention)
AttentionMaskInterface.register(GROUPED, eager_mask)


@contextmanager
def attention_scope(model: Any, dispatch: AttentionDispatch) -> Iterator[None]:
    """Within this block (this thread), ``model`` attends through ``dispatch``; its own attention
    implementation is restored after."""
    outer = model.config._attn_implementation
    model.set_attn_implementation(ENGINE)
    try:
        with dispatch.active():
            yield
    finally:
        model.set_attn_implementation(outer)
