"""Public entry points for the tree-verify ops, one function per op and engine layout.

Each picks the Triton kernel where Triton has a real device (all tensors on CUDA) and the torch
reference otherwise (``backend="auto"``); ``backend="triton"`` forces the kernel (on CPU only
under ``TRITON_INTERPRET=1``, as the tests do) and ``backend="torch"`` forces the reference.

Engine layouts:

* **vLLM**, either of its GPU cache layouts, told apart by rank:
  ``[2, num_blocks, block_size, Hkv, D]`` (FlashAttention backend; index 0 = K, 1 = V), or the
  Triton backend's ``[num_blocks, Hkv, block_size, 2 * D]`` (logical order, any stride order: K is
  the first ``D`` of the last dimension, V the second, as its ``transpose(1, 2).split(D, -1)``);
  ``block_table`` ``[B, max_blocks]``; ``seq_lens`` and ``query_start_loc`` as in its attention
  metadata. Request ``b``'s logical position ``p`` is block ``block_table[b, p // block_size]``
  (``block_table_rows`` picks other rows of a bigger table: the engine's whole batch). vLLM's
  CPU backend packs its cache per ISA and is not such a layout.
* **SGLang 0.5.23**: token pool ``k_buffer``/``v_buffer`` ``[pool_size, Hkv, D]`` (one layer),
  ``req_to_token`` ``[max_reqs, max_context]`` slot ids and ``req_pool_indices`` ``[B]``
  (page size 1). SGLang's ``batch.seq_lens`` excludes the verify window, so pass
  ``seq_lens + N`` here.

In both, ``seq_lens[b]`` counts the request's tree tokens, whose K/V are already in the cache at
the last ``T_b`` logical positions; see :mod:`dyntree.kernels.tree_attention` for the rest of the
contract and :mod:`dyntree.kernels.tree_accept` for the accept semantics.
"""

from __future__ import annotations

import math

import torch

from dyntree.kernels import kv_compact as _kvc
from dyntree.kernels import tree_accept as _acc
from dyntree.kernels import tree_attention as _attn
from dyntree.kernels._triton import Backend, resolve_backend

__all__ = [
    "tree_attention_vllm",
    "tree_attention_sglang",
    "tree_accept_greedy",
    "tree_accept_sampling",
    "kv_compact_vllm",
    "kv_compact_sglang",
]


def _vllm_views(kv_cache: torch.Tensor, head_dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[num_blocks, block_size, Hkv, D]`` views of one layer's vLLM GPU cache (either
    layout; ``head_dim``: the queries' ``D``, which the Triton layout's last dimension must double)."""
    if kv_cache.dim() == 5 and kv_cache.shape[0] == 2:
        return kv_cache[0], kv_cache[1]
    if kv_cache.dim() == 4 and kv_cache.shape[3] % 2 == 0 and head_dim in (None, kv_cache.shape[3] // 2):
        k, v = kv_cache.transpose(1, 2).split(kv_cache.shape[3] // 2, dim=-1)
        return k, v
    raise ValueError(
        "kv_cache must be vLLM's [2, num_blocks, block_size, num_kv_heads, head_size] or its Triton backend's "
        f"[num_blocks, num_kv_heads, block_size, 2 * head_size], got {tuple(kv_cache.shape)}"
    )


def _sglang_views(k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    for name, buf in (("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if buf.dim() != 3:
            raise ValueError(f"{name} must be SGLang's [pool_size, num_kv_heads, head_dim], got {tuple(buf.shape)}")
    return k_buffer.unsqueeze(1), v_buffer.unsqueeze(1)


def _attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tree_bits: torch.Tensor | None,
    scale: float | None,
    rows: torch.Tensor | None,
    max_seq_len: int | None,
    backend: Backend,
) -> torch.Tensor:
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    tensors = [q, k_cache, page_table, seq_lens, query_start_loc] + ([tree_bits] if tree_bits is not None else [])
    if resolve_backend(backend, *tensors) == "triton":
        return _attn.paged_tree_attention_triton(
            q, k_cache, v_cache, page_table, seq_lens, query_start_loc, tree_bits, scale, rows,
            max_seq_len=max_seq_len,
        )
    return _attn.paged_tree_attention_reference(
        q, k_cache, v_cache, page_table, seq_lens, query_start_loc, tree_bits, scale, rows
    )


def tree_attention_vllm(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tree_bits: torch.Tensor | None,
    scale: float | None = None,
    *,
    block_table_rows: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Tree attention over vLLM's paged cache; returns ``[N, Hq, D]`` like ``q``.

    ``tree_bits`` ``[B, T_max, W]`` from :func:`~dyntree.kernels.tree_attention.pack_ancestor_bits`
    (``None``: causal chain). ``scale`` defaults to ``head_dim ** -0.5``; ``max_seq_len`` avoids a
    device sync when the kernel splits long prefixes.
    """
    k_cache, v_cache = _vllm_views(kv_cache, q.shape[-1])
    return _attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, tree_bits, scale, block_table_rows,
                      max_seq_len, backend)


def tree_attention_sglang(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tree_bits: torch.Tensor | None,
    scale: float | None = None,
    *,
    max_seq_len: int | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Tree attention over SGLang's token pool (page size 1); ``seq_lens`` includes the tree."""
    k_cache, v_cache = _sglang_views(k_buffer, v_buffer)
    return _attention(
        q, k_cache, v_cache, req_to_token, seq_lens, query_start_loc, tree_bits, scale, req_pool_indices,
        max_seq_len, backend,
    )


def tree_accept_greedy(
    tokens: torch.Tensor, parents: torch.Tensor, target_argmax: torch.Tensor, *, backend: Backend = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy tree accept: ``(accept_index [B, T], accept_len [B] incl. root, bonus [B])``."""
    if resolve_backend(backend, tokens, parents, target_argmax) == "triton":
        return _acc.tree_accept_greedy_triton(tokens, parents, target_argmax)
    return _acc.tree_accept_greedy_reference(tokens, parents, target_argmax)


def tree_accept_sampling(
    parents: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    coins: torch.Tensor,
    *,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampling tree accept (per-node ``coin < min(1, p/q)``, lowest-index descent):
    ``(accept_index [B, T], accept_len [B] incl. root)``."""
    if resolve_backend(backend, parents, target_probs, draft_probs, coins) == "triton":
        return _acc.tree_accept_sampling_triton(parents, target_probs, draft_probs, coins)
    return _acc.tree_accept_sampling_reference(parents, target_probs, draft_probs, coins)


def kv_compact_vllm(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    accept_index: torch.Tensor,
    accept_len: torch.Tensor,
    *,
    block_table_rows: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> None:
    """In place: move each request's accepted nodes to positions ``prefix_lens[b] + k`` (one layer)."""
    k_cache, v_cache = _vllm_views(kv_cache)
    if resolve_backend(backend, kv_cache, block_table, prefix_lens, accept_index, accept_len) == "triton":
        _kvc.kv_compact_triton(k_cache, v_cache, block_table, prefix_lens, accept_index, accept_len, block_table_rows)
    else:
        _kvc.kv_compact_reference(k_cache, v_cache, block_table, prefix_lens, accept_index, accept_len, block_table_rows)


def kv_compact_sglang(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    accept_index: torch.Tensor,
    accept_len: torch.Tensor,
    *,
    backend: Backend = "auto",
) -> None:
    """In place, SGLang token pool (one layer); ``prefix_lens`` is SGLang's ``batch.seq_lens``."""
    k_cache, v_cache = _sglang_views(k_buffer, v_buffer)
    tensors = (k_buffer, req_to_token, req_pool_indices, prefix_lens, accept_index, accept_len)
    if resolve_backend(backend, *tensors) == "triton":
        _kvc.kv_compact_triton(k_cache, v_cache, req_to_token, prefix_lens, accept_index, accept_len, req_pool_indices)
    else:
        _kvc.kv_compact_reference(k_cache, v_cache, req_to_token, prefix_lens, accept_index, accept_len, req_pool_indices)
