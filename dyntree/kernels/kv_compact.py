"""KV compaction after tree accept: move the accepted path's K/V right behind the prefix.

Before verify, tree node ``j`` of request ``b`` sits at logical position ``prefix_lens[b] + j``
of the paged cache (same layout contract as :mod:`dyntree.kernels.tree_attention`:
``[num_pages, page_size, Hkv, D]`` caches, any strides with ``D`` contiguous, so the K and V
halves of vLLM's Triton-backend cache are plain views; ``page_table``/``page_table_rows``). After accept,
the ``k``-th node of the path, ``accept_index[b, k]``, must sit at ``prefix_lens[b] + k`` for
``k < accept_len[b]``, so the next step's prefix is contiguous. Positions past the path are left
as they are (the engine rolls them back).

Overlap: source and destination ranges overlap (both are the request's tree window). The
semantics are "read every source, then write every destination". Along a path node indices
strictly increase and ``accept_index[b, k] >= k``, so destination ``k`` can only be the source of
an *earlier* path entry ``m < k`` (when ``accept_index[b, m] == k``), never of a later one: a
sequential copy in increasing ``k`` is safe. The Triton kernel copies all entries at once, so it
stages instead: each program loads its column slice of every source row of one request into
registers, waits at a barrier, then stores; programs touch disjoint (request, column) slices.
"""

from __future__ import annotations

import torch

from dyntree.kernels._triton import HAS_TRITON, next_pow2, tl, triton

__all__ = ["check_compact_inputs", "kv_compact_reference", "kv_compact_triton"]


def check_compact_inputs(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    accept_index: torch.Tensor,
    accept_len: torch.Tensor,
    page_table_rows: torch.Tensor | None,
) -> None:
    """Shape checks shared by both implementations (no device sync)."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            "k_cache and v_cache must both be [num_pages, page_size, num_kv_heads, head_dim] of one "
            f"dtype, got {tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}"
        )
    if accept_index.dim() != 2:
        raise ValueError(f"accept_index must be [B, L], got {tuple(accept_index.shape)}")
    b = accept_index.shape[0]
    for name, t in (("prefix_lens", prefix_lens), ("accept_len", accept_len)):
        if t.shape != (b,):
            raise ValueError(f"{name} must have shape [{b}] (one per request), got {tuple(t.shape)}")
    if page_table.dim() != 2:
        raise ValueError(f"page_table must be 2-D [rows, pages_per_row], got {tuple(page_table.shape)}")
    if page_table_rows is not None and page_table_rows.shape != (b,):
        raise ValueError(f"page_table_rows must have shape [{b}], got {tuple(page_table_rows.shape)}")


def _slots(page_table: torch.Tensor, row: int, pos: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return page_table[row, pos // page_size].long(), pos % page_size


def kv_compact_reference(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    accept_index: torch.Tensor,
    accept_len: torch.Tensor,
    page_table_rows: torch.Tensor | None = None,
) -> None:
    """In place, per request: gather the path's K/V (a copy), then scatter it behind the prefix."""
    check_compact_inputs(k_cache, v_cache, page_table, prefix_lens, accept_index, accept_len, page_table_rows)
    page_size = k_cache.shape[1]
    for b in range(accept_index.shape[0]):
        n = int(accept_len[b])
        if not 0 <= n <= accept_index.shape[1]:
            raise ValueError(f"accept_len[{b}]={n} is outside [0, {accept_index.shape[1]}]")
        row = b if page_table_rows is None else int(page_table_rows[b])
        prefix = int(prefix_lens[b])
        nodes = accept_index[b, :n].long()
        src_page, src_off = _slots(page_table, row, prefix + nodes, page_size)
        dst_page, dst_off = _slots(page_table, row, prefix + torch.arange(n, device=nodes.device), page_size)
        for cache in (k_cache, v_cache):
            cache[dst_page, dst_off] = cache[src_page, src_off].clone()


if HAS_TRITON:

    @triton.jit
    def _kv_compact_kernel(
        K, V, PT, PT_ROWS, PREFIX, IDX, LEN,
        stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh, stride_ptr, stride_idx, row_elems,
        HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        b = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        col_ok = cols < row_elems
        k_cols = (cols // HEAD_DIM).to(tl.int64) * stride_kh + cols % HEAD_DIM  # (head, dim) -> offset in a slot
        v_cols = (cols // HEAD_DIM).to(tl.int64) * stride_vh + cols % HEAD_DIM
        n = tl.load(LEN + b).to(tl.int32)
        prefix = tl.load(PREFIX + b).to(tl.int32)
        pt_row = PT + tl.load(PT_ROWS + b).to(tl.int64) * stride_ptr
        k = tl.arange(0, BLOCK_L)
        node = tl.load(IDX + b * stride_idx + k, mask=k < n, other=0).to(tl.int32)
        move = (k < n) & (node != k)  # entries already in place need no copy
        src = prefix + node
        dst = prefix + k
        src_page = tl.load(pt_row + src // PAGE_SIZE, mask=move, other=0).to(tl.int64)
        dst_page = tl.load(pt_row + dst // PAGE_SIZE, mask=move, other=0).to(tl.int64)
        src_off = (src % PAGE_SIZE).to(tl.int64)
        dst_off = (dst % PAGE_SIZE).to(tl.int64)
        m = move[:, None] & col_ok[None, :]
        k_src = K + (src_page * stride_kp + src_off * stride_ko)[:, None] + k_cols[None, :]
        v_src = V + (src_page * stride_vp + src_off * stride_vo)[:, None] + v_cols[None, :]
        k_rows = tl.load(k_src, mask=m)
        v_rows = tl.load(v_src, mask=m)
        tl.debug_barrier()  # every source row is read before any destination is written
        tl.store(K + (dst_page * stride_kp + dst_off * stride_ko)[:, None] + k_cols[None, :], k_rows, mask=m)
        tl.store(V + (dst_page * stride_vp + dst_off * stride_vo)[:, None] + v_cols[None, :], v_rows, mask=m)


def kv_compact_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    accept_index: torch.Tensor,
    accept_len: torch.Tensor,
    page_table_rows: torch.Tensor | None = None,
    *,
    block_c: int | None = None,
) -> None:
    """Triton KV compaction, in place (same contract as :func:`kv_compact_reference`)."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    check_compact_inputs(k_cache, v_cache, page_table, prefix_lens, accept_index, accept_len, page_table_rows)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(3) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension")
    if accept_index.stride(1) != 1:
        raise ValueError("accept_index must be contiguous along the path dimension")
    b, width = accept_index.shape
    if b == 0 or width == 0:
        return
    row_elems = k_cache.shape[2] * k_cache.shape[3]
    block_l = max(2, next_pow2(width))
    # Stage at most ~8k elements per tensor per program (registers), wide rows in several programs.
    block_c = block_c or max(16, min(256, 8192 // block_l))
    block_c = min(block_c, max(16, next_pow2(row_elems)))
    rows = page_table_rows
    if rows is None:
        rows = torch.arange(b, dtype=torch.int32, device=k_cache.device)
    grid = (b, triton.cdiv(row_elems, block_c))
    _kv_compact_kernel[grid](
        k_cache, v_cache, page_table, rows, prefix_lens, accept_index, accept_len,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), page_table.stride(0), accept_index.stride(0), row_elems,
        HEAD_DIM=k_cache.shape[3], PAGE_SIZE=k_cache.shape[1], BLOCK_L=block_l, BLOCK_C=block_c,
    )
