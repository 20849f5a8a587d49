"""Triton kernels for tree verification, each with a readable torch reference beside it, and the
formats and references they define (packed ancestor masks, the quantized weight format, the
tree-accept references) plus the CPU ops: torch's low-bit matmuls (:mod:`~dyntree.kernels.cpu_weight_only`)
and the calibrated routing of few-row linears and attention (:mod:`~dyntree.kernels.cpu_linear`,
:mod:`~dyntree.kernels.cpu_attention`). This package imports no other ``dyntree`` package: the core
and the engines build on it.

Public ops (Triton on CUDA, torch reference elsewhere; see :mod:`dyntree.kernels.dispatch`):
paged tree attention for vLLM and SGLang KV layouts, greedy and sampling tree accept, and KV
compaction of the accepted path. Importing this package does not require Triton, and loads the
kernel modules only when one of these names is first used (so the core can import the formats
without building any kernel).
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "HAS_TRITON": "_triton",
    "pack_ancestor_bits": "ancestor_bits",
    "unpack_ancestor_bits": "ancestor_bits",
    "tree_attention_vllm": "dispatch",
    "tree_attention_sglang": "dispatch",
    "tree_accept_greedy": "dispatch",
    "tree_accept_sampling": "dispatch",
    "kv_compact_vllm": "dispatch",
    "kv_compact_sglang": "dispatch",
}

__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'dyntree.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f"dyntree.kernels.{module}"), name)
