"""Guarded Triton import and the rule that decides where a Triton kernel may run.

Kernel modules import ``triton``/``tl`` from here, so the package imports fine without Triton
(``HAS_TRITON`` is then False and only the torch references are available). A Triton kernel runs
on CUDA tensors, or on CPU tensors when the process runs Triton's interpreter
(``TRITON_INTERPRET=1`` set before the kernel modules were imported).
"""

from __future__ import annotations

import os
from typing import Literal

import torch

try:  # pragma: no cover - exercised by whichever environment runs the tests
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "Backend", "triton", "tl", "interpreting", "resolve_backend", "next_pow2"]

Backend = Literal["auto", "triton", "torch"]


def interpreting() -> bool:
    """True when Triton kernels in this process were built for the CPU interpreter."""
    return HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(backend: Backend, *tensors: torch.Tensor) -> Literal["triton", "torch"]:
    """Pick the implementation for an op.

    ``"auto"`` selects Triton only where it has a real device (every tensor on CUDA and Triton
    importable), else the torch reference. ``"triton"`` forces the kernel and raises if it cannot
    run here (no Triton, or CPU tensors without the interpreter). ``"torch"`` forces the reference.
    """
    if backend == "torch":
        return "torch"
    on_cuda = all(t.is_cuda for t in tensors)
    if backend == "auto":
        return "triton" if HAS_TRITON and on_cuda else "torch"
    if backend != "triton":
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if not HAS_TRITON:
        raise RuntimeError("backend='triton' requested but triton is not installed")
    if not on_cuda and not interpreting():
        raise RuntimeError(
            "backend='triton' with CPU tensors needs TRITON_INTERPRET=1 set before "
            "dyntree.kernels is imported"
        )
    return "triton"


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``max(n, 1)``."""
    return 1 << max(int(n) - 1, 0).bit_length()
