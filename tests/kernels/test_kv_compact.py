"""KV compaction: the reference against a sequential in-order copy (the overlap argument), and the
Triton kernel (interpreter) against the reference for both engine layouts and several page sizes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _kernel_cases import paged_case, random_tree
from dyntree.common.tree import TreeBatch
from dyntree.kernels import dispatch
from dyntree.kernels._triton import HAS_TRITON
from dyntree.kernels.kv_compact import kv_compact_reference

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def _paths(gen: torch.Generator, trees) -> tuple[torch.Tensor, torch.Tensor]:
    """A random root-to-node path per tree, as accept_index/accept_len."""
    batch = TreeBatch.from_trees(trees)
    index = torch.full(batch.tokens.shape, -1, dtype=torch.int64)
    lens = []
    for r, tree in enumerate(trees):
        path = tree.path(int(torch.randint(0, tree.size, (1,), generator=gen)))
        index[r, : len(path)] = torch.tensor(path)
        lens.append(len(path))
    return index, torch.tensor(lens, dtype=torch.int64)


def _sequential(kv: torch.Tensor, block_table, prefix, index, lens) -> None:
    """Copy entry k = 0, 1, ... one at a time, in place, straight from the (changing) cache."""
    bs = kv.shape[2]
    for b in range(index.shape[0]):
        for k in range(int(lens[b])):
            s, d = int(prefix[b]) + int(index[b, k]), int(prefix[b]) + k
            kv[:, block_table[b, d // bs], d % bs] = kv[:, block_table[b, s // bs], s % bs]


@settings(max_examples=20, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 10), min_size=1, max_size=3), st.sampled_from([1, 2, 4]), st.integers(0, 2**31 - 1))
def test_reference_equals_sequential_in_order_copy(sizes, block_size: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    trees = [random_tree(gen, n) for n in sizes]
    case = paged_case(gen, trees, [3] * len(sizes), 2, 2, 16, block_size)
    index, lens = _paths(gen, trees)
    prefix = case.seq_lens - torch.tensor(sizes, dtype=torch.int32)
    want = case.kv_cache.clone()
    _sequential(want, case.block_table, prefix, index, lens)
    got = case.kv_cache.clone()
    kv_compact_reference(got[0], got[1], case.block_table, prefix, index, lens)
    assert torch.equal(got, want)


def test_overlapping_move_keeps_every_source() -> None:
    # Path 0 -> 2 -> 3: destination 2 is the source of entry 1, so a parallel copy that wrote
    # entry 2 before reading entry 1 would lose node 2's K/V.
    kv = torch.arange(2 * 8 * 1 * 1 * 1, dtype=torch.float32).view(2, 8, 1, 1, 1)
    table = torch.arange(8, dtype=torch.int32).view(1, 8)
    index = torch.tensor([[0, 2, 3, -1]])
    lens, prefix = torch.tensor([3]), torch.tensor([4])
    dispatch.kv_compact_vllm(kv, table, prefix, index, lens, backend="torch")
    assert kv[0, :, 0, 0, 0].tolist() == [0, 1, 2, 3, 4, 6, 7, 7]
    if HAS_TRITON:
        kv2 = torch.arange(16, dtype=torch.float32).view(2, 8, 1, 1, 1)
        dispatch.kv_compact_vllm(kv2, table, prefix, index, lens, backend="triton")
        assert torch.equal(kv2, kv)


@needs_triton
@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    st.lists(st.integers(1, 12), min_size=1, max_size=3),
    st.sampled_from([1, 3, 4, 16]),
    st.sampled_from([(1, 16), (2, 64), (3, 64)]),
    st.integers(0, 2**31 - 1),
)
def test_triton_matches_reference_both_layouts(sizes, block_size: int, heads_dim, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    trees = [random_tree(gen, n) for n in sizes]
    hkv, d = heads_dim
    case = paged_case(gen, trees, [int(torch.randint(0, 30, (1,), generator=gen)) for _ in sizes], hkv, hkv, d, block_size)
    index, lens = _paths(gen, trees)
    prefix = case.seq_lens - torch.tensor(sizes, dtype=torch.int32)
    want = case.kv_cache.clone()
    dispatch.kv_compact_vllm(want, case.block_table, prefix, index, lens, backend="torch")
    got = case.kv_cache.clone()
    dispatch.kv_compact_vllm(got, case.block_table, prefix, index, lens, backend="triton")
    assert torch.equal(got, want)
    # SGLang view of the same cache (shuffled req_to_token rows) must give the same result.
    k_buf, v_buf = case.k_buffer.clone(), case.v_buffer.clone()
    dispatch.kv_compact_sglang(k_buf, v_buf, case.req_to_token, case.req_pool_indices, prefix, index, lens, backend="triton")
    assert torch.equal(k_buf.view_as(want[0]), want[0]) and torch.equal(v_buf.view_as(want[1]), want[1])
    # vLLM's Triton-backend layout of the same cache: [blocks, Hkv, block, 2D], stored NHD (K and V
    # interleaved per head within a slot), must give the same result too.
    nhd = torch.cat([case.kv_cache[0], case.kv_cache[1]], dim=-1).permute(0, 2, 1, 3)
    dispatch.kv_compact_vllm(nhd, case.block_table, prefix, index, lens, backend="triton")
    assert torch.equal(nhd[..., :d].transpose(1, 2), want[0]) and torch.equal(nhd[..., d:].transpose(1, 2), want[1])


def test_compact_errors_name_fields() -> None:
    kv = torch.zeros(2, 4, 2, 1, 8)
    table = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="accept_len"):
        dispatch.kv_compact_vllm(kv, table, torch.tensor([0]), torch.zeros(1, 3, dtype=torch.long), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="accept_len\\[0\\]=5"):
        dispatch.kv_compact_vllm(kv, table, torch.tensor([0]), torch.zeros(1, 3, dtype=torch.long), torch.tensor([5]), backend="torch")
