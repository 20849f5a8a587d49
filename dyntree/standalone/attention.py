"""The engine's attention as a transformers attention function, and the scope that switches a
model to it.

``"dyntree"`` runs :func:`dyntree.kernels.cpu_attention.attend` (the calibrated choice among three
K/V-copy-free implementations; see that module) on the additive 4-D masks the engine passes, and
unmasked on one-token forwards the engine passes no mask for (its mask function then builds none:
every row sees its whole cache); anything it does not handle (soft-capping, sliding windows,
attention sinks, dropout, no mask for several tokens) goes to transformers' own ``sdpa``. The
engine hands its routing and the forward's layout to the model call as keyword arguments, which
transformers passes on to every attention call (:data:`DISPATCH`, :data:`LAYOUT`). In a ragged
verify forward (a :class:`~dyntree.standalone.kv.RaggedLayout`) the queries arrive flat, ``[1, H,
N, D]``, against the batch's ``[B, KV, L, D]`` cache and a ``[B, 1, T, L]`` mask: rows of one
width attend as one batch, and so, padded to the widest, do rows of several widths, unless the
calibrated timings predict that splitting pays: every row's root in one batched call and each
longer row's other tokens over its own cache row (a view). Reading the cache dominates a few
query rows, so small trees pad and only a few wide ones split.
``"dyntree_grouped"`` is always the two-matmul form, which distillation-data generation uses for
its batched greedy decoding.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import eager_mask

from dyntree.kernels.cpu_attention import AttentionDispatch, attend, grouped_matmul
from dyntree.standalone.kv import RaggedLayout

__all__ = ["DISPATCH", "ENGINE", "GROUPED", "LAYOUT", "attention_scope", "grouped_attention"]

#: The registered names: the engine's calibrated routing, and always the two-matmul form.
ENGINE, GROUPED = "dyntree", "dyntree_grouped"
#: The model-call keyword arguments the engine's attention reads: its
#: :class:`~dyntree.kernels.cpu_attention.AttentionDispatch` and the forward's ragged layout.
DISPATCH, LAYOUT = "dyntree_attention", "dyntree_layout"

_UNHANDLED = ("softcap", "sliding_window", "s_aux")


def _engine_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    layout: RaggedLayout | None = kwargs.pop(LAYOUT, None)
    dispatch: AttentionDispatch | None = kwargs.pop(DISPATCH, None)
    rows = query.shape[2] if layout is None else layout.width
    masked = attention_mask is not None and attention_mask.dtype != torch.bool
    plain = ((masked or (attention_mask is None and rows == 1)) and dropout == 0.0
             and scaling is not None and not any(kwargs.get(k) is not None for k in _UNHANDLED))
    if not plain:
        q = query if layout is None else layout.pad(query)
        out, _ = sdpa_attention_forward(module, q, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                        **kwargs)
        return (out if layout is None else out[layout.rows.to(out.device), layout.cols.to(out.device)][None]), None
    if layout is None:
        return attend(query, key, value, attention_mask, scaling, dispatch).transpose(1, 2).contiguous(), None
    return _ragged(layout, query, key, value, attention_mask, scaling, dispatch), None


def _split_pays(layout: RaggedLayout, keys: int, dispatch: AttentionDispatch | None) -> bool:
    """Whether attending the roots in one call and each longer row's other tokens in a call of
    its own is predicted (by ``dispatch``'s calibrated timings) to beat one call over the padded
    ``[B, T]`` batch. Reading the cache dominates a few query rows, so padding is nearly free for
    small trees and the split pays only for a few wide ones; without a dispatch, pad."""
    if dispatch is None:
        return False
    split = dispatch.cost_us(layout.batch, 1, keys) + sum(
        dispatch.cost_us(1, size - 1, keys) for size in layout.sizes if size > 1)
    return split < dispatch.cost_us(layout.batch, layout.width, keys)


def _ragged(layout: RaggedLayout, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            mask: torch.Tensor | None, scaling: float, dispatch: AttentionDispatch | None) -> torch.Tensor:
    """``[1, N, H, D]`` attention of flat ``[1, H, N, D]`` queries, each over its own row of the
    ``[B, KV, L, D]`` cache, by the ``[B, 1, T, L]`` additive mask (``None``: one token per row,
    seeing its whole row)."""
    n, h, d = query.shape[2], query.shape[1], query.shape[3]
    if layout.uniform:
        return attend(layout.pad(query), key, value, mask, scaling, dispatch).transpose(1, 2).reshape(1, n, h, d)
    if not _split_pays(layout, key.shape[2], dispatch):
        out = attend(layout.pad(query), key, value, mask, scaling, dispatch)  # [B, H, T, D]
        return out[layout.rows.to(query.device), :, layout.cols.to(query.device)][None]
    out = query.new_empty(n, h, d)
    roots = torch.tensor(layout.starts, device=query.device)
    first = attend(query[0, :, roots].transpose(0, 1)[:, :, None], key, value,
                   None if mask is None else mask[:, :, :1], scaling, dispatch)  # [B, H, 1, D]
    out[roots] = first[:, :, 0]
    for b, (start, size) in enumerate(zip(layout.starts, layout.sizes)):
        if size > 1:
            rest = attend(query[:, :, start + 1 : start + size], key[b : b + 1], value[b : b + 1],
                          None if mask is None else mask[b : b + 1, :, 1:size], scaling, dispatch)  # [1, H, size - 1, D]
            out[start + 1 : start + size] = rest[0].transpose(0, 1)
    return out[None]


def grouped_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                      **_: Any) -> tuple[torch.Tensor, None]:
    """Eager attention without repeating K/V per query group (Hugging Face's ``repeat_kv`` copies the
    whole cache every step)."""
    return grouped_matmul(query, key, value, attention_mask, scaling).transpose(1, 2).contiguous(), None


def _engine_mask(*args: Any, q_length: int, attention_mask: torch.Tensor | None = None,
                 **kwargs: Any) -> torch.Tensor | None:
    """transformers' eager 4-D mask, except none for one query token per row without a padding
    mask (the engine passes ``attention_mask=None`` only for tokens that see their whole cache
    row, and runs a forward of one token per row as a ``[B, 1]`` batch, not a ragged one)."""
    if attention_mask is None and q_length == 1:
        return None
    return eager_mask(*args, q_length=q_length, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(ENGINE, _engine_attention)
AttentionMaskInterface.register(ENGINE, _engine_mask)
AttentionInterface.register(GROUPED, grouped_attention)
AttentionMaskInterface.register(GROUPED, eager_mask)


@contextmanager
def attention_scope(model: Any) -> Iterator[None]:
    """Within this block, ``model`` attends through the engine's attention (routed by the
    :data:`DISPATCH` its calls pass; without one, ``gqa`` everywhere); its own attention
    implementation is restored after."""
    outer = model.config._attn_implementation
    if outer != ENGINE:  # switching walks the model: an inner scope (a step) keeps the outer's
        model.set_attn_implementation(ENGINE)
    try:
        yield
    finally:
        if outer != ENGINE:
            model.set_attn_implementation(outer)
