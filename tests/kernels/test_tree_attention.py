"""Paged tree attention: bit packing, the torch reference against dense SDPA, and the Triton
kernel (interpreter) against the reference over random trees, layouts, GQA ratios and splits."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _kernel_cases import paged_case, random_tree
from dyntree.common.tree import DraftTree, TreeBatch
from dyntree.kernels import dispatch
from dyntree.kernels._triton import HAS_TRITON
from dyntree.kernels.tree_attention import (
    pack_ancestor_bits,
    paged_tree_attention_reference,
    paged_tree_attention_triton,
    unpack_ancestor_bits,
)

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
FAST = settings(max_examples=10, deadline=None, derandomize=True)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.integers(1, 3), st.integers(1, 70), st.integers(0, 2**31 - 1))
def test_pack_roundtrip_and_bit_positions(b: int, t: int, seed: int) -> None:
    mask = torch.rand(b, t, t, generator=torch.Generator().manual_seed(seed)) < 0.5
    bits = pack_ancestor_bits(mask)
    assert bits.shape == (b, t, -(-t // 32)) and bits.dtype == torch.int32
    assert torch.equal(unpack_ancestor_bits(bits, t), mask)
    i, j = t - 1, t - 1  # spot-check one bit by hand
    assert bool((int(bits[0, i, j // 32]) >> (j % 32)) & 1) == bool(mask[0, i, j])


def test_pack_word_layout() -> None:
    mask = torch.zeros(1, 33, 33, dtype=torch.bool)
    mask[0, 0, 0] = mask[0, 0, 31] = mask[0, 0, 32] = True
    bits = pack_ancestor_bits(mask)
    assert int(bits[0, 0, 0]) == 1 - 2**31  # bits 0 and 31: negative two's-complement word
    assert int(bits[0, 0, 1]) == 1
    with pytest.raises(ValueError, match=r"\[B, T, T\]"):
        pack_ancestor_bits(torch.zeros(2, 3, 4, dtype=torch.bool))


def _dense_sdpa(case, scale: float, causal: bool) -> torch.Tensor:
    """Independent check of the reference: contiguous K/V, dense mask, torch SDPA."""
    k_cache, v_cache = case.kv_cache[0], case.kv_cache[1]
    bs = k_cache.shape[1]
    outs = []
    qsl = case.query_start_loc.tolist()
    for b in range(len(qsl) - 1):
        t, s = qsl[b + 1] - qsl[b], int(case.seq_lens[b])
        flat = torch.cat([k_cache[int(case.block_table[b, i])] for i in range(-(-s // bs))])[:s]
        vflat = torch.cat([v_cache[int(case.block_table[b, i])] for i in range(-(-s // bs))])[:s]
        mask = torch.ones(t, s, dtype=torch.bool)
        tree = torch.ones(t, t, dtype=torch.bool).tril() if causal else unpack_ancestor_bits(case.tree_bits[b : b + 1, :t], t)[0]
        mask[:, s - t :] = tree
        q = case.q[qsl[b] : qsl[b + 1]].transpose(0, 1)  # [Hq, t, D]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, flat.transpose(0, 1), vflat.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True
        )
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_dense_sdpa(causal: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    trees = [random_tree(gen, 6), random_tree(gen, 1), random_tree(gen, 9)]
    case = paged_case(gen, trees, [13, 0, 40], num_q_heads=6, num_kv_heads=2, head_dim=16, block_size=4)
    bits = None if causal else case.tree_bits
    ref = paged_tree_attention_reference(
        case.q, case.kv_cache[0], case.kv_cache[1], case.block_table, case.seq_lens, case.query_start_loc, bits, 0.3
    )
    torch.testing.assert_close(ref, _dense_sdpa(case, 0.3, causal), atol=1e-5, rtol=1e-5)


def test_padding_rows_see_prefix_and_themselves() -> None:
    gen = torch.Generator().manual_seed(2)
    trees = [DraftTree.chain(3, [4, 5, 6]), DraftTree.root_only(7)]
    batch = TreeBatch.from_trees(trees)
    case = paged_case(gen, trees, [5, 8], num_q_heads=2, num_kv_heads=1, head_dim=16, block_size=2)
    # Give request 1 the padded width: its 3 padding nodes follow the root in the cache.
    seq_lens = torch.tensor([9, 8 + 4], dtype=torch.int32)
    qsl = torch.tensor([0, 4, 8], dtype=torch.int32)
    q = torch.randn(8, 2, 16, generator=gen)
    kv = torch.randn(2, 20, 2, 1, 16, generator=gen)
    block_table = torch.arange(20, dtype=torch.int32).view(2, 10)
    out = paged_tree_attention_reference(q, kv[0], kv[1], block_table, seq_lens, qsl, pack_ancestor_bits(batch.mask), 0.25)
    # Padding node 2 of request 1 (query row 6) sees positions 0..7 and its own slot 8 + 2.
    keys = kv[0].reshape(40, 1, 16)[20:][[*range(8), 10]]
    vals = kv[1].reshape(40, 1, 16)[20:][[*range(8), 10]]
    probs = torch.softmax(torch.einsum("hd,shd->hs", q[6], keys.expand(-1, 2, -1)) * 0.25, dim=-1)
    torch.testing.assert_close(out[6], torch.einsum("hs,shd->hd", probs, vals.expand(-1, 2, -1)))
    del case


@needs_triton
@FAST
@given(
    data=st.data(),
    heads=st.sampled_from([(1, 1), (4, 2), (3, 3), (6, 2), (8, 1)]),
    block_size=st.sampled_from([1, 3, 4, 16]),
    causal=st.booleans(),
    num_splits=st.sampled_from([1, 2, 3]),
)
def test_triton_matches_reference_vllm(data, heads, block_size: int, causal: bool, num_splits: int) -> None:
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    sizes = data.draw(st.lists(st.integers(1, 7), min_size=1, max_size=3), label="tree sizes")
    prefixes = data.draw(st.lists(st.integers(0, 40), min_size=len(sizes), max_size=len(sizes)), label="prefixes")
    case = paged_case(gen, [random_tree(gen, n) for n in sizes], prefixes, heads[0], heads[1], 64, block_size)
    bits = None if causal else case.tree_bits
    args = (case.q, case.kv_cache[0], case.kv_cache[1], case.block_table, case.seq_lens, case.query_start_loc, bits, 0.125)
    ref = paged_tree_attention_reference(*args)
    out = paged_tree_attention_triton(*args, num_splits=num_splits, block_n=16)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@needs_triton
@pytest.mark.parametrize("head_dim,dtype,tol", [(128, torch.float32, 2e-5), (64, torch.float16, 2e-3)])
def test_triton_head_dims_and_fp16(head_dim: int, dtype: torch.dtype, tol: float) -> None:
    gen = torch.Generator().manual_seed(3)
    trees = [random_tree(gen, 5), random_tree(gen, 11)]
    case = paged_case(gen, trees, [33, 17], 4, 1, head_dim, 16, dtype=dtype)
    args = (case.q, case.kv_cache[0], case.kv_cache[1], case.block_table, case.seq_lens, case.query_start_loc, case.tree_bits, head_dim**-0.5)
    ref = paged_tree_attention_reference(*args)
    out = paged_tree_attention_triton(*args, num_splits=2)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@needs_triton
def test_sglang_layout_matches_vllm_layout() -> None:
    gen = torch.Generator().manual_seed(4)
    trees = [random_tree(gen, 4), random_tree(gen, 6)]
    case = paged_case(gen, trees, [9, 21], 4, 2, 64, 4)
    ref = dispatch.tree_attention_vllm(
        case.q, case.kv_cache, case.block_table, case.seq_lens, case.query_start_loc, case.tree_bits, backend="torch"
    )
    for backend in ("torch", "triton"):
        out = dispatch.tree_attention_sglang(
            case.q, case.k_buffer, case.v_buffer, case.req_to_token, case.req_pool_indices, case.seq_lens,
            case.query_start_loc, case.tree_bits, backend=backend,
        )
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@needs_triton
def test_chain_tree_equals_causal_mode() -> None:
    gen = torch.Generator().manual_seed(5)
    trees = [DraftTree.chain(1, [2, 3, 4, 5]), DraftTree.chain(1, [2, 3])]
    case = paged_case(gen, trees, [20, 3], 2, 2, 64, 8)
    args = (case.q, case.kv_cache, case.block_table, case.seq_lens, case.query_start_loc)
    tree = dispatch.tree_attention_vllm(*args, case.tree_bits, backend="triton")
    causal = dispatch.tree_attention_vllm(*args, None, backend="triton")
    torch.testing.assert_close(tree, causal, atol=1e-6, rtol=1e-6)
    branchy = case.tree_bits.clone()
    branchy[0, 3] = 0b1001  # node 3 now hangs off the root: its output must change
    assert not torch.allclose(dispatch.tree_attention_vllm(*args, branchy, backend="triton")[3], causal[3], atol=1e-4)


def test_auto_backend_uses_reference_on_cpu_and_errors_name_fields() -> None:
    gen = torch.Generator().manual_seed(6)
    case = paged_case(gen, [random_tree(gen, 3)], [5], 4, 2, 16, 4)
    args = (case.q, case.kv_cache, case.block_table, case.seq_lens, case.query_start_loc, case.tree_bits)
    out = dispatch.tree_attention_vllm(*args)  # head_dim 16 on CPU: the reference path
    ref = paged_tree_attention_reference(
        case.q, case.kv_cache[0], case.kv_cache[1], case.block_table, case.seq_lens, case.query_start_loc,
        case.tree_bits, 1 / math.sqrt(16),
    )
    torch.testing.assert_close(out, ref)
    with pytest.raises(ValueError, match="kv_cache"):
        dispatch.tree_attention_vllm(case.q, case.kv_cache[0], *args[2:])
    with pytest.raises(ValueError, match="num_q_heads=3"):
        dispatch.tree_attention_vllm(torch.randn(3, 3, 16), *args[1:])
    with pytest.raises(ValueError, match="seq_lens"):
        dispatch.tree_attention_vllm(case.q, case.kv_cache, case.block_table, case.seq_lens[:0], *args[4:])
