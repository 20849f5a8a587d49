"""Paged tree attention: one fused pass over each request's cached prefix and its draft tree.

Layout contract (both engines reduce to it; see :mod:`dyntree.kernels.dispatch` for the
engine-facing wrappers):

* ``q``: ``[N, Hq, D]``, the tree tokens of all requests packed back to back; request ``b``
  owns rows ``query_start_loc[b] : query_start_loc[b + 1]`` (``T_b`` rows, node order).
* ``k_cache``/``v_cache``: ``[num_pages, page_size, Hkv, D]`` paged caches. Logical position
  ``p`` of request ``b`` lives at page ``page_table[page_table_rows[b], p // page_size]``,
  offset ``p % page_size``. vLLM 0.32 is ``kv_cache[0]``/``kv_cache[1]`` of its
  ``[2, num_blocks, block_size, Hkv, D]`` cache with ``block_table``; SGLang is its token pool
  ``[size, Hkv, D]`` viewed with ``page_size == 1`` and ``page_table = req_to_token``,
  ``page_table_rows = req_pool_indices``.
* ``seq_lens[b]``: the request's total KV length *including* its ``T_b`` tree tokens, whose K/V
  the engine has already written at logical positions ``[seq_lens[b] - T_b, seq_lens[b])``
  (tree node ``j`` at ``prefix_len + j``, where ``prefix_len = seq_lens[b] - T_b``).
* ``tree_bits``: ``[B, T_max, W]`` int32 from :func:`pack_ancestor_bits`. Query row ``t`` of
  request ``b`` sees every prefix position and tree node ``j`` iff bit ``j % 32`` of word
  ``tree_bits[b, t, j // 32]`` is set. ``None`` means a plain causal chain (node ``t`` sees
  nodes ``0..t``): ordinary paged attention with ``T_b`` query tokens, the baseline a tree must
  match in cost.

GQA maps query head ``h`` to KV head ``h // (Hq // Hkv)``. The Triton kernel runs one program
per (request, tile of ``BLOCK_M`` (token, query-head) rows of one KV-head group, KV split), so
each KV page is read once per KV head for all tree tokens and all query heads of the group, as
in plain paged decode-attention with ``T_b`` query tokens. Long prefixes with few programs are
split along the KV axis (flash-decoding) and merged with their log-sum-exp.
"""

from __future__ import annotations

import math

import torch

from dyntree.kernels.ancestor_bits import WORD_BITS, pack_ancestor_bits, unpack_ancestor_bits
from dyntree.kernels._triton import HAS_TRITON, next_pow2, tl, triton

__all__ = [
    "WORD_BITS",
    "pack_ancestor_bits",
    "unpack_ancestor_bits",
    "check_paged_inputs",
    "paged_tree_attention_reference",
    "paged_tree_attention_triton",
]

def check_paged_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tree_bits: torch.Tensor | None,
    page_table_rows: torch.Tensor | None,
) -> None:
    """Shape and dtype checks shared by both implementations (no device sync)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_pages, page_size, num_kv_heads, head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"head_dim differs: q has {d}, k_cache has {k_cache.shape[3]}")
    if hq % hkv != 0:
        raise ValueError(f"num_q_heads={hq} is not a multiple of num_kv_heads={hkv}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"dtype mismatch: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    if query_start_loc.dim() != 1 or query_start_loc.numel() < 2:
        raise ValueError("query_start_loc must be a 1-D tensor of B + 1 offsets")
    b = query_start_loc.numel() - 1
    if seq_lens.shape != (b,):
        raise ValueError(f"seq_lens must have shape [{b}] (one per request), got {tuple(seq_lens.shape)}")
    if page_table.dim() != 2:
        raise ValueError(f"page_table must be 2-D [rows, pages_per_row], got {tuple(page_table.shape)}")
    for name, t in (("page_table", page_table), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if page_table_rows is not None and page_table_rows.shape != (b,):
        raise ValueError(f"page_table_rows must have shape [{b}], got {tuple(page_table_rows.shape)}")
    if tree_bits is not None:
        if tree_bits.dim() != 3 or tree_bits.shape[0] != b or tree_bits.dtype != torch.int32:
            raise ValueError(
                f"tree_bits must be [B={b}, T_max, W] int32, got {tuple(tree_bits.shape)} {tree_bits.dtype}"
            )
        if tree_bits.shape[2] * WORD_BITS < tree_bits.shape[1]:
            raise ValueError(
                f"tree_bits has {tree_bits.shape[2]} words per row: too few for T_max={tree_bits.shape[1]}"
            )


def paged_tree_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tree_bits: torch.Tensor | None,
    scale: float,
    page_table_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Readable torch reference: gather each request's K/V, build its dense mask, softmax in fp32."""
    check_paged_inputs(q, k_cache, v_cache, page_table, seq_lens, query_start_loc, tree_bits, page_table_rows)
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // hkv
    out = torch.empty_like(q)
    qsl = query_start_loc.tolist()
    for b in range(len(qsl) - 1):
        q_start, q_end = qsl[b], qsl[b + 1]
        t, s = q_end - q_start, int(seq_lens[b])
        prefix = s - t
        if t < 0 or prefix < 0:
            raise ValueError(f"request {b}: seq_lens={s} is smaller than its {t} query tokens")
        if tree_bits is not None and t > tree_bits.shape[1]:
            raise ValueError(f"request {b} has {t} query tokens but tree_bits has T_max={tree_bits.shape[1]}")
        if t == 0:
            continue
        row = b if page_table_rows is None else int(page_table_rows[b])
        pos = torch.arange(s, device=q.device)
        pages = page_table[row, pos // page_size].long()
        k = k_cache[pages, pos % page_size]  # [s, Hkv, D]
        v = v_cache[pages, pos % page_size]
        visible = torch.ones(t, s, dtype=torch.bool, device=q.device)
        if tree_bits is None:
            visible[:, prefix:] = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        else:
            visible[:, prefix:] = unpack_ancestor_bits(tree_bits[b : b + 1, :t], t)[0]
        k = k.repeat_interleave(group, dim=1).float()
        v = v.repeat_interleave(group, dim=1).float()
        scores = torch.einsum("thd,shd->hts", q[q_start:q_end].float(), k) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hts,shd->thd", probs, v).to(q.dtype)
    return out


if HAS_TRITON:

    @triton.jit
    def _attend_tile(
        q, acc, m_i, l_i, K, V, pt_row, kpos, kv_ok, visible, kvh, scale_log2,
        stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh,
        HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PREC: tl.constexpr,
    ):
        """One online-softmax step over ``BLOCK_N`` paged KV positions."""
        d = tl.arange(0, HEAD_DIM)
        page = tl.load(pt_row + kpos // PAGE_SIZE, mask=kv_ok, other=0).to(tl.int64)
        off = (kpos % PAGE_SIZE).to(tl.int64)
        k_off = page * stride_kp + off * stride_ko + kvh * stride_kh
        v_off = page * stride_vp + off * stride_vo + kvh * stride_vh
        k_t = tl.load(K + k_off[None, :] + d[:, None], mask=kv_ok[None, :], other=0.0)
        v = tl.load(V + v_off[:, None] + d[None, :], mask=kv_ok[:, None], other=0.0)
        qk = tl.dot(q, k_t, input_precision=DOT_PREC) * scale_log2
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        return acc, m_new, l_i

    @triton.jit
    def _tree_attn_kernel(
        Q, K, V, PT, PT_ROWS, SEQ_LENS, QSL, BITS, OUT, LSE,
        scale_log2, split_len,
        stride_qt, stride_qh,
        stride_kp, stride_ko, stride_kh,
        stride_vp, stride_vo, stride_vh,
        stride_ptr, stride_bb, stride_bt,
        stride_os, stride_ot, stride_oh,
        stride_ls, stride_lt,
        Q_TILES: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        IS_TREE: tl.constexpr, WRITE_LSE: tl.constexpr, DOT_PREC: tl.constexpr,
    ):
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        b = pid // Q_TILES
        q_tile = pid % Q_TILES
        q_start = tl.load(QSL + b).to(tl.int32)
        q_len = tl.load(QSL + b + 1).to(tl.int32) - q_start
        if q_tile * BLOCK_M < q_len * GROUP:
            seq_len = tl.load(SEQ_LENS + b).to(tl.int32)
            prefix_len = seq_len - q_len
            lo = split * split_len
            hi = tl.minimum(lo + split_len, seq_len)
            pt_row = PT + tl.load(PT_ROWS + b).to(tl.int64) * stride_ptr

            r = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
            t = r // GROUP
            head = kvh * GROUP + r % GROUP
            row_ok = t < q_len
            d = tl.arange(0, HEAD_DIM)
            tok = (q_start + t).to(tl.int64)
            q = tl.load(
                Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0,
            )
            m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

            # Prefix: every query sees every cached position.
            prefix_hi = tl.minimum(hi, prefix_len)
            for start in range(lo, prefix_hi, BLOCK_N):
                kpos = start + tl.arange(0, BLOCK_N)
                kv_ok = kpos < prefix_hi
                acc, m_i, l_i = _attend_tile(
                    q, acc, m_i, l_i, K, V, pt_row, kpos, kv_ok, kv_ok[None, :], kvh, scale_log2,
                    stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh,
                    HEAD_DIM, PAGE_SIZE, DOT_PREC,
                )
            # Tree part: node j visible to query t iff bit j of t's ancestor row (or j <= t).
            for start in range(tl.maximum(lo, prefix_len), hi, BLOCK_N):
                kpos = start + tl.arange(0, BLOCK_N)
                kv_ok = kpos < hi
                j = kpos - prefix_len
                if IS_TREE:
                    words = tl.load(
                        BITS + b * stride_bb + t[:, None] * stride_bt + (j // 32)[None, :],
                        mask=row_ok[:, None] & kv_ok[None, :], other=0,
                    )
                    visible = ((words >> (j % 32)[None, :]) & 1) != 0
                else:
                    visible = j[None, :] <= t[:, None]
                acc, m_i, l_i = _attend_tile(
                    q, acc, m_i, l_i, K, V, pt_row, kpos, kv_ok, visible & kv_ok[None, :], kvh,
                    scale_log2, stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh,
                    HEAD_DIM, PAGE_SIZE, DOT_PREC,
                )

            empty = l_i == 0.0
            l_safe = tl.where(empty, 1.0, l_i)
            o = acc / l_safe[:, None]
            o_ptrs = OUT + split * stride_os + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
            if WRITE_LSE:
                tl.store(o_ptrs, o, mask=row_ok[:, None])
                lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe))
                tl.store(LSE + split * stride_ls + tok * stride_lt + head, lse, mask=row_ok)
            else:
                tl.store(o_ptrs, o.to(OUT.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _merge_splits_kernel(
        PART, LSE, OUT, num_splits,
        stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
        HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        """Combine per-split normalised outputs with their base-2 log-sum-exps."""
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, HEAD_DIM)
        s_ok = s < num_splits
        lse = tl.load(LSE + s * stride_ls + tok * stride_lt + head, mask=s_ok, other=float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.math.exp2(lse - m)
        total = tl.sum(w, 0)
        w = w / tl.where(total == 0.0, 1.0, total)
        part = tl.load(
            PART + s[:, None] * stride_ps + tok * stride_pt + head * stride_ph + d[None, :],
            mask=s_ok[:, None], other=0.0,
        )
        o = tl.sum(part * w[:, None], 0)
        tl.store(OUT + tok * stride_ot + head * stride_oh + d, o.to(OUT.dtype.element_ty))


def _default_num_splits(programs: int, max_seq_len: int, block_n: int, device: torch.device) -> int:
    """Split the KV axis until about two programs per SM run (CUDA), never below 4 tiles a split."""
    if device.type != "cuda" or max_seq_len <= 0:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= sms:
        return 1
    wanted = math.ceil(2 * sms / max(programs, 1))
    return max(1, min(wanted, math.ceil(max_seq_len / (4 * block_n)), 64))


def paged_tree_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tree_bits: torch.Tensor | None,
    scale: float,
    page_table_rows: torch.Tensor | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Triton paged tree attention (same contract as :func:`paged_tree_attention_reference`).

    ``max_query_len`` (default: ``tree_bits.shape[1]``, else read from ``query_start_loc``) and
    ``max_seq_len`` (read from ``seq_lens`` when needed and not given) size the grid; pass them to
    avoid a device sync. ``num_splits`` forces the KV split count (default: fill the GPU).
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    check_paged_inputs(q, k_cache, v_cache, page_table, seq_lens, query_start_loc, tree_bits, page_table_rows)
    n_tok, hq, d = q.shape
    hkv, page_size = k_cache.shape[2], k_cache.shape[1]
    group = hq // hkv
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"head_dim={d}: the Triton kernel needs a power of two in [16, 256]")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension")
    b = query_start_loc.numel() - 1
    if max_query_len is None:
        max_query_len = (
            tree_bits.shape[1] if tree_bits is not None else int((query_start_loc[1:] - query_start_loc[:-1]).max())
        )
    out = torch.empty_like(q)
    if n_tok == 0 or max_query_len == 0:
        return out
    rows = max_query_len * group
    bm = block_m or min(64, max(16, next_pow2(rows)))
    bn = block_n or (64 if d <= 64 else 32)  # sm_90 fp16, BLOCK_M 64: no register spills (ptxas)
    q_tiles = math.ceil(rows / bm)
    if num_splits is None:
        programs = b * q_tiles * hkv
        if q.is_cuda and programs < torch.cuda.get_device_properties(q.device).multi_processor_count:
            max_seq_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
            num_splits = _default_num_splits(programs, max_seq_len, bn, q.device)
        else:
            num_splits = 1
    if num_splits > 1:
        max_seq_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
        split_len = math.ceil(math.ceil(max_seq_len / num_splits) / bn) * bn
        num_splits = max(1, math.ceil(max_seq_len / split_len))
    if num_splits == 1:
        split_len = 2**31 - 1
    rows_idx = page_table_rows
    if rows_idx is None:
        rows_idx = torch.arange(b, dtype=torch.int32, device=q.device)
    bits = tree_bits if tree_bits is not None else torch.zeros(1, 1, 1, dtype=torch.int32, device=q.device)
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    scale_log2 = float(scale) * 1.4426950408889634
    common = dict(
        Q_TILES=q_tiles, GROUP=group, HEAD_DIM=d, PAGE_SIZE=page_size, BLOCK_M=bm, BLOCK_N=bn,
        IS_TREE=tree_bits is not None, DOT_PREC=dot_prec, num_warps=num_warps, num_stages=num_stages,
    )
    grid = (b * q_tiles, hkv, num_splits)
    kv_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                  v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
    if num_splits == 1:
        _tree_attn_kernel[grid](
            q, k_cache, v_cache, page_table, rows_idx, seq_lens, query_start_loc, bits, out, out,
            scale_log2, split_len, q.stride(0), q.stride(1), *kv_strides,
            page_table.stride(0), bits.stride(0), bits.stride(1),
            0, out.stride(0), out.stride(1), 0, 0, WRITE_LSE=False, **common,
        )
        return out
    part = torch.empty(num_splits, n_tok, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_splits, n_tok, hq, dtype=torch.float32, device=q.device)
    _tree_attn_kernel[grid](
        q, k_cache, v_cache, page_table, rows_idx, seq_lens, query_start_loc, bits, part, lse,
        scale_log2, split_len, q.stride(0), q.stride(1), *kv_strides,
        page_table.stride(0), bits.stride(0), bits.stride(1),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        WRITE_LSE=True, **common,
    )
    _merge_splits_kernel[(n_tok, hq)](
        part, lse, out, num_splits, part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=d, BLOCK_S=max(2, next_pow2(num_splits)), num_warps=num_warps,
    )
    return out
