"""Greedy decoding's LM head at half the bytes: an fp16 screen that settles each row's argmax
exactly, and the full-precision head only for the rows it cannot settle.

A greedy step needs each row's argmax of ``l = h W^T`` (an fp32 head ``W`` ``[V, d]``), not its
logits. A decoding step's head streams all of ``W`` from memory for a few rows; :class:`ScreenedHead`
reads an fp16 copy instead (FBGEMM's fp16 GEMM: fp32 activations and accumulation, half the
bytes), whose logits ``a`` differ from the fp32 head's by at most ``||h||_2 c_j`` per token ``j``:

* the weights' fp16 rounding: ``|h . (W16_j - W_j)| <= ||h|| ||W16_j - W_j||`` (Cauchy-Schwarz,
  with ``W16`` read back from the packed copy, so whatever rounding the packing did is counted);
* both products' fp32 rounding, in any summation order: ``gamma_d (||W16_j|| + ||W_j||) ||h||``
  with ``gamma_d = d u / (1 - d u)``, ``u = 2^-24``;
* the screen's own fp32 arithmetic on ``a +- ||h|| c``: an absolute ``2^-18 max_j ||W16_j||`` per
  unit of ``||h||`` (``|a_j| <= ||h|| ||W16_j||``), and a relative ``2^-10`` on the whole bound.

A row settles when its best token's lower bound ``a_i - ||h|| c_i`` exceeds every other token's
upper bound ``a_j + ||h|| c_j`` (the two largest ``a``, the largest ``c`` for the runner-up: one
``topk``): then ``i`` is the fp32 head's strict argmax. A row that does not settle so has a few
candidates (the tokens whose upper bound reaches the best lower bound; the argmax is one of them),
whose dot products :meth:`ScreenedHead.screen` computes in float64 from ``W``: each is within
``gamma_d sum_i |h_i W_ji|`` of the fp32 head's logit (any summation order), so a candidate whose
float64 value beats every other's by more than both bounds is the fp32 head's argmax. A row
left unsettled then holds candidates closer than the fp32 head's worst-case rounding (or
non-finite states: comparisons with NaN fail), and only the head can say which its arithmetic picks:
:meth:`ScreenedHead.logits` runs the caller's head on those rows and returns logits whose argmax
is the head's in every row (``-inf`` but ``0`` at the winner for the settled rows). Only the
argmax is kept: sampling needs the full head.

The reference: ``head(h).argmax(-1)`` (``torch.argmax``'s first maximum; :func:`reference_argmax`).
"""

from __future__ import annotations

from typing import Callable

import torch

from dyntree.kernels.cpu_weight_only import fp16_available

__all__ = ["ScreenedHead", "reference_argmax"]

_U = 2.0**-24  # fp32 unit roundoff
_ABS = 2.0**-18  # the screen's own fp32 rounding, per unit of ||h|| ||W16_j|| (see the module docstring)
_REL = 1 + 2.0**-10


def _gamma(d: int, u: float = _U) -> float:
    """The rounding bound of a length-``d`` dot product in any summation order, relative to
    ``sum |x_i y_i|``."""
    return d * u / (1 - d * u)


def reference_argmax(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
    """The head's argmax per row, as the screen must reproduce it."""
    return head(hidden).argmax(-1)


class ScreenedHead:
    """An fp32 LM head's fp16 screen (see the module docstring); build with :meth:`build`."""

    def __init__(self, weight: torch.Tensor, packed: torch.Tensor, bound: torch.Tensor) -> None:
        self.weight = weight  # W itself (the engine's tensor, not a copy): the candidates' products
        self.packed = packed  # FBGEMM's fp16 copy of W
        self.bound = bound  # [V] fp32: c_j, the screen's error per unit of ||h||
        self.bound_max = float(bound.max())
        self.vocab, d = weight.shape
        # per unit of sum_i |h_i W_ji|: the fp32 head's rounding, and the float64 products' own, by
        # which a candidate's float64 value may miss the head's logit
        self.exact_slack = (_gamma(d) + _gamma(d, 2.0**-53)) * _REL

    @staticmethod
    def available() -> bool:
        """Whether this torch has FBGEMM's fp16 GEMM (x86 CPUs) and can read its packed copy back."""
        return fp16_available() and hasattr(torch.ops.quantized, "linear_unpack_fp16")

    @classmethod
    def build(cls, weight: torch.Tensor) -> "ScreenedHead | None":
        """The screen of an fp32 CPU head ``weight`` ``[V, d]``; ``None`` where it cannot serve
        (another dtype or device, no FBGEMM fp16 GEMM, or weights beyond fp16's range)."""
        if weight.dim() != 2 or weight.shape[0] < 2 or weight.dtype != torch.float32 or weight.device.type != "cpu" \
                or not cls.available():
            return None
        w = weight.detach().contiguous()
        if not bool(w.isfinite().all()) or float(w.abs().max()) > torch.finfo(torch.float16).max:
            return None
        packed = torch.ops.quantized.linear_prepack_fp16(w, None)
        w16 = torch.ops.quantized.linear_unpack_fp16(packed)[0]  # fp16 values, exact in fp32
        norm16 = w16.norm(dim=1)  # fp32 norms: their rounding (< d u) is within _REL
        c = (w16 - w).norm(dim=1) + _gamma(w.shape[1]) * (norm16 + w.norm(dim=1)) + _ABS * float(norm16.max())
        return cls(w, packed, c * _REL)

    def screen(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N]`` int64: each row's argmax of the fp32 head where the screen settles it, ``-1``
        where it does not (``hidden``: ``[N, d]`` fp32)."""
        a = torch.ops.quantized.linear_dynamic_fp16(hidden.contiguous(), self.packed)
        r = hidden.norm(dim=1)
        top, idx = a.topk(2, dim=1)
        best = idx[:, 0]
        low = top[:, 0] - r * self.bound[best]
        settled = low > top[:, 1] + r * self.bound_max
        winners = torch.where(settled, best, -1)
        for row in (~settled).nonzero().flatten().tolist():  # the candidates' products in float64
            cand = (a[row] + r[row] * self.bound >= low[row]).nonzero().flatten()
            if cand.numel() == 0:  # non-finite
                continue
            w, h = self.weight[cand].double(), hidden[row].double()
            exact = w @ h
            slack = self.exact_slack * (w.abs() @ h.abs())
            k = int(exact.argmax())
            reach = exact + slack
            reach[k] = float("-inf")
            if bool(exact[k] - slack[k] > reach.max()):
                winners[row] = cand[k]
        return winners

    def logits(self, hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``[N, V]`` logits whose argmax is the fp32 head's in every row: ``head``'s own logits
        for the rows the screen does not settle (``head`` runs on those rows only), ``-inf`` but
        ``0`` at the winner for the others."""
        winners = self.screen(hidden)
        out = torch.full((hidden.shape[0], self.vocab), float("-inf"), dtype=torch.float32, device=hidden.device)
        settled = winners >= 0
        rows = settled.nonzero().flatten()
        out[rows, winners[rows]] = 0.0
        if rows.numel() < hidden.shape[0]:
            left = (~settled).nonzero().flatten()
            out[left] = head(hidden[left]).to(out.dtype)
        return out
