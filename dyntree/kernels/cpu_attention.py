"""Attention for few-query forwards on a CPU, routed by a per-CPU calibration (torch only).

Engines verify trees with an explicit additive mask, and with a mask transformers' ``sdpa`` repeats
every KV head's cache once per query group before calling ``scaled_dot_product_attention``: two
copies of the whole cache per layer per step. Worse, on a CPU in bf16 the fused kernel can handle
one or a few query rows far from the memory bound, while in fp32, or with 16 query rows, it is
often the fastest (``docs/measurements.md``, CPU attention). So three equivalent ways are kept,
none copying K/V per group:

* ``gqa``: ``scaled_dot_product_attention(..., enable_gqa=True)`` with the mask;
* ``rows``: the query heads of one KV head stacked as the rows of one fused call;
* ``matmul``: the same stacking through two matmuls and a float32 softmax.

:func:`calibrate` times the three at a grid of (batch, query rows, cached tokens), over caches
that are views of bigger buffers as the engines' are, for a head shape
and dtype (once, kept on disk per CPU, torch version, threads, dtype and shape), and
:class:`AttentionDispatch` picks, per call, the fastest at the nearest grid point (log scale).
:func:`attend` follows the dispatch it is given, and is ``gqa`` without one. The three compute
the same attention with a different summation order, like any two kernels; fp32 results agree to
rounding.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Callable, ContextManager, Mapping

import torch
import torch.nn.functional as F

from dyntree.kernels.cpu_linear import cpu_name

__all__ = ["AttentionDispatch", "IMPLS", "attend", "calibrate", "grouped_matmul"]

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", float], torch.Tensor]

#: Grid timed by :func:`calibrate`: batch rows, query rows per sequence, cached tokens.
GRID_BATCH = (1, 4, 16)
GRID_QUERY = (1, 4, 16, 64)
GRID_KV = (64, 256, 1024)
_CACHE_VERSION = 3


def grouped_matmul(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                   scaling: float) -> torch.Tensor:
    """``[b, h, q, d]`` attention of ``query`` over ``[b, kv_heads, L, d]`` keys and values: the
    query heads of one KV head become the rows of one matmul; ``mask``: additive ``[b, 1, q, L]``."""
    b, h, q, d = query.shape
    kv_heads = key.shape[1]
    groups = h // kv_heads
    # a cache view (the first slots of a bigger buffer) is copied first: on a CPU the product over
    # the view costs several times the copy plus the product
    w = torch.matmul(query.reshape(b, kv_heads, groups * q, d), key.contiguous().transpose(2, 3)) * scaling
    if mask is not None:  # the same for every head
        w = (w.view(b, kv_heads, groups, q, -1) + mask[:, :, None]).view(b, kv_heads, groups * q, -1)
    w = torch.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(w, value).view(b, h, q, d)


def _rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
          scaling: float) -> torch.Tensor:
    b, h, q, d = query.shape
    kv_heads = key.shape[1]
    groups = h // kv_heads
    if mask is not None:
        mask = mask[:, :, None].expand(b, 1, groups, q, mask.shape[-1]).reshape(b, 1, groups * q, mask.shape[-1])
    out = F.scaled_dot_product_attention(query.reshape(b, kv_heads, groups * q, d), key, value, attn_mask=mask,
                                         scale=scaling)
    return out.view(b, h, q, d)


def _gqa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
         scaling: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                          enable_gqa=key.shape[1] != query.shape[1])


#: The interchangeable implementations, by name: ``[b, h, q, d]`` out, additive mask or none.
IMPLS: dict[str, Attention] = {"gqa": _gqa, "rows": _rows, "matmul": grouped_matmul}


def _nearest(grid: tuple[int, ...], x: int) -> int:
    return min(grid, key=lambda g: abs(math.log(g) - math.log(max(x, 1))))


class AttentionDispatch:
    """Picks the fastest implementation for a call's (batch, query rows, cached tokens) from
    calibrated timings at the nearest grid point (log distance per axis)."""

    def __init__(self, timings_us: Mapping[tuple[int, int, int], Mapping[str, float]]) -> None:
        if not timings_us:
            raise ValueError("AttentionDispatch needs timings")
        unknown = {n for v in timings_us.values() for n in v} - set(IMPLS)
        if unknown:
            raise ValueError(f"unknown attention implementation(s) {sorted(unknown)}; known: {sorted(IMPLS)}")
        self.timings_us = {k: dict(v) for k, v in timings_us.items()}
        self.batch = tuple(sorted({k[0] for k in timings_us}))
        self.query = tuple(sorted({k[1] for k in timings_us}))
        self.kv = tuple(sorted({k[2] for k in timings_us}))
        self._best = {k: min(v, key=v.__getitem__) for k, v in self.timings_us.items()}
        self._last: tuple[tuple[int, int, int], str] = ((0, 0, 0), "gqa")  # every layer of a forward asks alike

    def pick(self, batch: int, query: int, kv: int) -> str:
        """The implementation's name for a call of this shape: ``gqa`` (fused, no score matrix in
        memory) beyond twice the largest calibrated query rows (a prefill), else the fastest at
        the nearest grid point."""
        shape = (batch, query, kv)
        if shape != self._last[0]:
            name = "gqa" if query > 2 * self.query[-1] else \
                self._best[(_nearest(self.batch, batch), _nearest(self.query, query), _nearest(self.kv, kv))]
            self._last = (shape, name)
        return self._last[1]

    def cost_us(self, batch: int, query: int, kv: int) -> float:
        """The calibrated microseconds of the fastest form at the nearest grid point."""
        return self.timings_us[(_nearest(self.batch, batch), _nearest(self.query, query), _nearest(self.kv, kv))][
            self.pick(batch, query, kv)] if query <= 2 * self.query[-1] else math.inf

    def summary(self) -> str:
        names = list(self._best.values())
        return ", ".join(f"{n} at {names.count(n)} of {len(names)} grid points" for n in sorted(set(names)))


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
           scaling: float, dispatch: AttentionDispatch | None = None) -> torch.Tensor:
    """``[b, h, q, d]`` attention (additive ``mask`` or none) by ``dispatch``, ``gqa`` without
    one. Under a dispatch, one query row without a mask (a plain decoding
    step, a draft chain's forward) never takes ``gqa``: unmasked, ``rows`` beat it at every
    calibration shape with one query row where it was measured (``docs/measurements.md``), while
    the calibration times masked calls."""
    if dispatch is None:
        name = "gqa"
    else:
        name = dispatch.pick(query.shape[0], query.shape[2], key.shape[2])
        if name == "gqa" and mask is None and query.shape[2] == 1:
            name = "rows"
    return IMPLS[name](query, key, value, mask, scaling)


Grid = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def _fingerprint(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, grid: Grid) -> str:
    key = json.dumps([_CACHE_VERSION, cpu_name(), torch.__version__, torch.get_num_threads(), str(dtype),
                      heads, kv_heads, head_dim, grid])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def calibrate(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, repeats: int = 5,
              cache_dir: Path | None = None, grid: Grid = (GRID_BATCH, GRID_QUERY, GRID_KV),
              announce: Callable[[str], ContextManager[None]] | None = None) -> AttentionDispatch:
    """Time every implementation at every ``grid`` point (batch, query rows, cached tokens) on CPU
    tensors of this head shape and dtype (best of ``repeats``, interleaved, after a warm-up; a tree-shaped mask).
    With ``cache_dir``, timings are read from / written to a JSON file there keyed by the CPU,
    torch, threads, dtype, shape and grid. ``announce(what)`` wraps the timing when it runs (the
    caller's progress line)."""
    path = cache_dir / f"attention-{_fingerprint(heads, kv_heads, head_dim, dtype, grid)}.json" if cache_dir else None
    if path is not None and path.is_file():
        try:
            raw = json.loads(path.read_text())
            return AttentionDispatch({tuple(int(x) for x in k.split(",")): v for k, v in raw.items()})
        except (ValueError, TypeError, AttributeError):
            pass  # a damaged cache file is re-measured and rewritten
    g = torch.Generator().manual_seed(0)
    timings: dict[tuple[int, int, int], dict[str, float]] = {}
    points = len(grid[0]) * len(grid[1]) * len(grid[2])
    where = f"; cached in {path.parent}" if path is not None else ""
    say = announce or (lambda _: contextlib.nullcontext())
    with say(f"timing this CPU's attention forms at {points} shapes (once per machine{where})"), \
            torch.inference_mode():
        for b in grid[0]:
            for q in grid[1]:
                for kv in grid[2]:
                    query = torch.randn(b, heads, q, head_dim, generator=g).to(dtype)
                    # a cache is the first slots of a buffer with headroom (a view, as engines hold it)
                    spare = max(kv // 4, 16)
                    key = torch.randn(b, kv_heads, kv + q + spare, head_dim, generator=g).to(dtype)[:, :, : kv + q]
                    value = torch.randn(b, kv_heads, kv + q + spare, head_dim, generator=g).to(dtype)[:, :, : kv + q]
                    allowed = torch.ones(q, kv + q, dtype=torch.bool).tril(kv)
                    mask = torch.zeros(b, 1, q, kv + q, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
                    times: dict[str, list[float]] = {name: [] for name in IMPLS}
                    for name, fn in IMPLS.items():
                        fn(query, key, value, mask, head_dim**-0.5)  # warm-up
                    for _ in range(repeats):  # interleaved: a burst of load slows every form alike
                        for name, fn in IMPLS.items():
                            t = time.perf_counter()
                            fn(query, key, value, mask, head_dim**-0.5)
                            times[name].append(time.perf_counter() - t)
                    timings[(b, q, kv)] = {name: round(min(ts) * 1e6, 1) for name, ts in times.items()}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({",".join(map(str, k)): v for k, v in timings.items()}))
    return AttentionDispatch(timings)
