"""Triton kernels for tree verification, each with a readable torch reference beside it.

Public ops (Triton on CUDA, torch reference elsewhere; see :mod:`dyntree.kernels.dispatch`):
paged tree attention for vLLM and SGLang KV layouts, greedy and sampling tree accept, and KV
compaction of the accepted path. Importing this package does not require Triton.
"""

from dyntree.kernels._triton import HAS_TRITON
from dyntree.kernels.dispatch import (
    kv_compact_sglang,
    kv_compact_vllm,
    tree_accept_greedy,
    tree_accept_sampling,
    tree_attention_sglang,
    tree_attention_vllm,
)
from dyntree.kernels.tree_attention import pack_ancestor_bits, unpack_ancestor_bits

__all__ = [
    "HAS_TRITON",
    "pack_ancestor_bits",
    "unpack_ancestor_bits",
    "tree_attention_vllm",
    "tree_attention_sglang",
    "tree_accept_greedy",
    "tree_accept_sampling",
    "kv_compact_vllm",
    "kv_compact_sglang",
]
