"""Builders for small random kernel test cases: trees, paged caches in both engine layouts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dyntree.common.tree import DraftTree, TreeBatch


def random_tree(gen: torch.Generator, size: int, vocab: int = 5) -> DraftTree:
    """A random tree of ``size`` nodes (parents before children) over a tiny vocabulary."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, size)]
    tokens = torch.randint(0, vocab, (size,), generator=gen)
    return DraftTree(tokens, torch.tensor(parents, dtype=torch.int64), torch.ones(size))


@dataclass
class PagedCase:
    """Packed tree queries over a paged cache, with both the vLLM and the SGLang views of it."""

    q: torch.Tensor  # [N, Hq, D]
    kv_cache: torch.Tensor  # vLLM [2, num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32, tree included
    query_start_loc: torch.Tensor  # [B + 1] int32
    tree_bits: torch.Tensor  # [B, T_max, W] int32
    k_buffer: torch.Tensor  # SGLang [pool, Hkv, D], same K values as kv_cache[0]
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor  # [R, max_ctx] int32
    req_pool_indices: torch.Tensor  # [B] int32


def paged_case(
    gen: torch.Generator,
    trees: list[DraftTree],
    prefix_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
) -> PagedCase:
    """Random queries/KV; each request's blocks are scattered over a shuffled block pool."""
    b = len(trees)
    sizes = [t.size for t in trees]
    seq = [p + n for p, n in zip(prefix_lens, sizes)]
    blocks = [-(-s // block_size) for s in seq]
    num_blocks = sum(blocks) + 2
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_table = torch.full((b, max(blocks) + 1), num_blocks - 1, dtype=torch.int32)
    used = 0
    for r in range(b):
        block_table[r, : blocks[r]] = perm[used : used + blocks[r]]
        used += blocks[r]
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(sum(sizes), num_q_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32)
    batch = TreeBatch.from_trees(trees)
    from dyntree.kernels.tree_attention import pack_ancestor_bits

    bits = pack_ancestor_bits(batch.mask)
    # SGLang view of the same data: token slots = block * block_size + offset, rows shuffled.
    rows = torch.randperm(b + 2, generator=gen)[:b].to(torch.int32)
    max_ctx = block_table.shape[1] * block_size
    req_to_token = torch.zeros(b + 2, max_ctx, dtype=torch.int32)
    pos = torch.arange(max_ctx)
    for r in range(b):
        req_to_token[rows[r]] = block_table[r, pos // block_size] * block_size + pos % block_size
    k_buffer = kv[0].reshape(num_blocks * block_size, num_kv_heads, head_dim)
    v_buffer = kv[1].reshape(num_blocks * block_size, num_kv_heads, head_dim)
    return PagedCase(
        q, kv, block_table, torch.tensor(seq, dtype=torch.int32), qsl, bits, k_buffer, v_buffer, req_to_token, rows
    )
