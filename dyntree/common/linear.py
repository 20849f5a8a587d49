"""Faster CPU linears for the few query tokens of decoding and tree verification.

``F.linear(x, W)`` (``x @ W.T``) sends a 2-16 row input to a GEMM path that on a CPU without AMX
runs far from the memory bound: SmolLM2's 210 decoder linears cost ~43 ms for 1 row, ~70-77 ms for
2-4 rows and ~79 ms for 16 rows (fp32, 2 AVX2 cores, one calibration), while the same product
computed as ``(W @ x.T).T`` costs ~33 ms for 1-4 rows (1 row padded to 2), ~52 ms for 8 and ~66 ms
for 16. In between it is irregular (13 rows ~106 ms), so a row count may be padded up to a larger one
that runs faster. Which path is faster depends on the CPU, the dtype and the row count, so
:func:`calibrate` times both on the model's own linears at every row count up to 16 and a few
beyond (~25 s for SmolLM2 in fp32 on 2 AVX2 cores, once: kept on disk per CPU, torch version,
threads, dtype and linear shapes), and :class:`LinearDispatch` then routes each call by its row
count. Routing is per thread and only inside :meth:`LinearDispatch.active`: :func:`linear` (what
core code such as the Hydra heads' LM-head product calls) and the ``nn.Linear`` modules that
:func:`install` reroutes through it run stock ``F.linear`` anywhere else (``model.generate`` in
benchmarks, another engine).

The two paths compute the same products with a different summation order, like any two GEMM
kernels: fp32 results agree to rounding, and plain and speculative decoding both go through it.

For draft-side weights (never the target's), :class:`Int8Weight` runs a linear as FBGEMM's
dynamic int8 GEMM (``torch.ops.quantized.linear_dynamic``): the weight stored
int8 per output channel, the input quantized per call. On an AVX2 CPU that moves a quarter of
the bytes and runs 2-5x faster than the fp32 product at 1-8 rows (SmolLM2's 8,192 x 576 Hydra
output rows: ~0.25-0.6 vs ~1.2-1.4 ms); the logits move by ~1-2% of their range, which changes
which tokens are drafted now and then, never the output (the target verifies every token).
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import threading
import time
import types
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import ContextManager, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Int8Weight", "LinearDispatch", "calibrate", "cpu_name", "install", "int8_available", "linear",
           "thread_scope", "CALIBRATION_ROWS"]

#: Row counts timed by :func:`calibrate`; a call with more rows than the last uses ``F.linear``.
CALIBRATION_ROWS = (*range(1, 17), 24, 32, 48, 64)
_CACHE_VERSION = 2


def _transposed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pad_to: int = 2) -> torch.Tensor:
    """``x @ W.T (+ b)`` computed as ``(W @ x.T).T`` over at least ``pad_to`` rows (the last row
    repeated; a 1-column product would take the slower matrix-vector path). The result is
    contiguous (a transposed view fed to the next linear takes a slow path)."""
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    if m < pad_to:
        rows = torch.cat([rows, rows[-1:].expand(pad_to - m, -1)])
    out = torch.mm(weight, rows.contiguous().t()).t()[:m].contiguous()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


_ACTIVE = threading.local()


@contextmanager
def thread_scope(store: threading.local, dispatch: object) -> Iterator[None]:
    """Within this block (this thread), ``store.dispatch`` is ``dispatch``; the outer one after."""
    outer = getattr(store, "dispatch", None)
    store.dispatch = dispatch
    try:
        yield
    finally:
        store.dispatch = outer


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, routed by the dispatch active in this thread (if any)."""
    dispatch = getattr(_ACTIVE, "dispatch", None)
    return dispatch.linear(x, weight, bias) if dispatch is not None else F.linear(x, weight, bias)


class LinearDispatch:
    """Routes a linear by its input row count ``m`` to the cheapest calibrated option: ``F.linear``
    at ``m`` rows, or ``(W @ x.T).T`` padded to some calibrated ``p >= m`` rows (at least 2).
    Beyond the last calibrated row count, ``F.linear``."""

    def __init__(self, timings_ms: Mapping[int, tuple[float, float]]) -> None:
        """``timings_ms``: rows -> (``F.linear`` ms, transposed ms) over all of a model's linears."""
        rows = sorted(int(r) for r in timings_ms)
        if not rows or rows[0] != 1:
            raise ValueError("LinearDispatch needs timings for 1 row")
        self.timings_ms = {r: (float(timings_ms[r][0]), float(timings_ms[r][1])) for r in rows}
        self._pad: list[int] = []  # m - 1 -> rows the transposed product pads to (0: F.linear)
        for m in range(1, rows[-1] + 1):
            above = [r for r in rows if r >= m]
            plain = self.timings_ms[above[0]][0]
            best = min(above, key=lambda r: self.timings_ms[r][1])
            self._pad.append(max(best, 2) if self.timings_ms[best][1] < 0.95 * plain else 0)

    def active(self) -> ContextManager[None]:
        """Within this block (this thread), :func:`linear` uses this routing."""
        return thread_scope(_ACTIVE, self)

    def pad_rows(self, m: int) -> int:
        """Rows the transposed product pads ``m`` input rows to; 0 means ``F.linear``."""
        return self._pad[m - 1] if 0 < m <= len(self._pad) else 0

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        pad = self.pad_rows(x.numel() // x.shape[-1]) if x.dim() >= 2 and x.device.type == "cpu" else 0
        return _transposed(x, weight, bias, pad) if pad else F.linear(x, weight, bias)

    @property
    def routes(self) -> bool:
        """Whether any row count takes the transposed product (else this is ``F.linear``)."""
        return any(self._pad)

    def summary(self) -> str:
        routed = {m: p for m, p in enumerate(self._pad, 1) if p}
        return f"(W @ x.T).T for rows {sorted(routed)}" if routed else "F.linear everywhere"


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear]


def cpu_name() -> str:
    """The CPU model name (what per-CPU calibration caches are keyed by)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _fingerprint(linears: Sequence[nn.Linear], rows: Sequence[int]) -> str:
    p = linears[0].weight
    key = json.dumps([_CACHE_VERSION, cpu_name(), torch.__version__, torch.get_num_threads(), str(p.dtype),
                      sorted(tuple(m.weight.shape) for m in linears), list(rows)])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def calibrate(model: nn.Module, rows: Sequence[int] = CALIBRATION_ROWS, repeats: int = 3,
              cache_dir: Path | None = None) -> LinearDispatch:
    """Time ``F.linear`` and the transposed product over all of ``model``'s linears (each with its
    own weights, so memory traffic is real) at each row count: best of ``repeats`` rounds over
    every row count, after a warm-up round. The routing compares row counts with each other, so
    each round times them all; timed one count after another, a slow spell of the machine made
    3 rows look as cheap as 4 when they cost 20% more, and padding 8 rows to 16 look best. With
    ``cache_dir``, timings are read from / written to a JSON file there keyed by the CPU, torch
    version, thread count, dtype and linear shapes."""
    linears = _linears(model)
    if not linears:
        return LinearDispatch({r: (1.0, 1.0) for r in rows})
    path = cache_dir / f"linear-{_fingerprint(linears, rows)}.json" if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            return LinearDispatch({int(r): tuple(ms) for r, ms in json.loads(path.read_text()).items()})
        except (ValueError, TypeError, AttributeError):
            pass  # a damaged cache file is re-measured and rewritten
    p = linears[0].weight
    with torch.inference_mode():
        inputs = {k: torch.randn(max(rows), k, dtype=p.dtype, device=p.device) for k in {m.in_features for m in linears}}

        def run(fn, m: int) -> float:
            t0 = time.perf_counter()
            for lin in linears:
                fn(inputs[lin.in_features][:m], lin.weight, lin.bias)
            return (time.perf_counter() - t0) * 1e3

        paths = (F.linear, functools.partial(_transposed, pad_to=2))
        best = {m: [float("inf"), float("inf")] for m in rows}
        for rep in range(repeats + 1):  # the first round warms up
            for m in rows:  # every round visits every row count (see above)
                for i, fn in enumerate(paths):
                    ms = run(fn, m)
                    best[m][i] = min(best[m][i], ms) if rep else best[m][i]
        timings = {m: (round(b[0], 3), round(b[1], 3)) for m, b in best.items()}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(timings))
    return LinearDispatch(timings)


def _routed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def install(module: nn.Module) -> nn.Module:
    """Route ``module``'s ``nn.Linear`` calls through :func:`linear` (idempotent; without an
    active dispatch they compute exactly what ``F.linear`` does). Returns ``module``."""
    for lin in _linears(module):
        lin.forward = types.MethodType(_routed_forward, lin)
    return module


def int8_available() -> bool:
    """Whether this torch has FBGEMM's dynamic int8 linear (x86 CPUs)."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(torch.ops.quantized, "linear_dynamic")


class Int8Weight:
    """``x @ W.T`` with ``W`` in int8, one symmetric scale per output row, and ``x``
    quantized per call (FBGEMM's dynamic int8 GEMM; CPU, fp32 in and out). Activations use 7 bits
    (``reduce_range``): full 8-bit activations saturate AVX2's int8 multiply-add and cost ~10% of
    the logits' range in error, against ~1-2%."""

    def __init__(self, weight: torch.Tensor) -> None:
        if not int8_available():
            raise RuntimeError("int8 draft linears need torch's FBGEMM engine (an x86 CPU build of torch)")
        w = weight.detach().float().cpu()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).double()
        with warnings.catch_warnings():  # torch 2.13 marks quantized tensors deprecated; this op still takes one
            warnings.simplefilter("ignore", UserWarning)
            codes = torch.quantize_per_channel(w, scales, torch.zeros_like(scales, dtype=torch.int64), 0, torch.qint8)
        self.out_features, self.in_features = w.shape
        self._packed = torch.ops.quantized.linear_prepack(codes, None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float().contiguous()
        out = torch.ops.quantized.linear_dynamic(rows, self._packed, True)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
