"""Faster CPU linears for the few query tokens of decoding and tree verification.

``F.linear(x, W)`` (``x @ W.T`` over the ``[out, in]`` weight) sends a 2-16 row input to a GEMM path
that on a CPU without AMX can run far from the memory bound, and the same product computed as
``(W @ x.T).T``, or by MKL's packed GEMM (``torch.ops.mkl._mkl_linear``, what torch's own compiler
uses for frozen fp32 linears; it packs each weight once), is often faster. MKL packs a weight for a
row count, but the packed layout has the same size for every row count, and a copy packed for
``P`` rows computes products of any ``m <= P`` rows correctly, so the routing keeps ONE packed copy
per weight, packed for :data:`PACK_ROWS` rows (the largest row count it serves), and calls it with
the input's own row count (no padding). The forms' speeds depend on the CPU, the dtype and the row
count, so :func:`calibrate` times all three on the model's own linears at every row count up to
17 and a few beyond (once: kept on disk per CPU, torch version, threads, dtype and linear shapes;
it also checks that the packed copy reproduces ``F.linear`` at every row count, and never routes
there where it does not), and :class:`LinearDispatch` then routes each call by its row count. The
packed copy costs one more copy of the weights; it follows in-place changes of its weight (it is
repacked when the weight's version or storage changes). The ``nn.Linear`` modules :func:`install`
reroutes follow the :class:`LinearRouter` they were installed with, an object their owner holds
and sets (the standalone engine: its target's router, on during its own forwards; the Hydra heads:
theirs, set from the engine's dispatch when they are built); with no dispatch set they run stock
``F.linear`` (``model.generate`` in benchmarks, another engine). A weight without a packed copy
(the Hydra heads') takes the best of the other two forms. Measurements behind these
choices: ``docs/measurements.md`` (CPU linears).

The forms compute the same products with a different summation order, like any two GEMM
kernels: fp32 results agree to rounding, and plain and speculative decoding both go through it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import platform
import threading
import time
import types
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable, ContextManager, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn


__all__ = ["LinearDispatch", "LinearRouter", "PackedWeight", "calibrate", "cpu_flags", "cpu_has_native_bf16", "cpu_name",
           "install", "mkl_packed_available", "CALIBRATION_ROWS", "PACK_ROWS"]

#: Row counts timed by :func:`calibrate`; a call with more rows than the last uses ``F.linear``.
CALIBRATION_ROWS = (*range(1, 18), 24, 32, 48, 64)
#: The row count weights are packed for: a packed copy serves products of up to this many rows.
PACK_ROWS = CALIBRATION_ROWS[-1]
_CACHE_VERSION = 5

#: The forms :class:`LinearDispatch` routes between.
LINEAR, TRANSPOSED, PACKED = "linear", "transposed", "packed"


_PAD = threading.local()  # scratch: each thread's padding buffers (a buffer is written, then read)


def _padded(x: torch.Tensor, pad_to: int) -> tuple[torch.Tensor, int]:
    """``x``'s rows as a 2-D tensor of at least ``pad_to`` rows, and how many rows are real. The
    padding rows hold whatever an earlier call left there (each output row of a product depends on
    its own input row only): a per-thread buffer, so no padding is built per call."""
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    if m >= pad_to:
        return rows, m
    if rows.requires_grad:
        return torch.cat([rows, rows.new_zeros(pad_to - m, rows.shape[1])]), m
    buffers: dict = _PAD.__dict__.setdefault("buffers", {})
    key = (pad_to, rows.shape[1], rows.dtype, rows.device, torch.is_inference_mode_enabled())
    buf = buffers.get(key)
    if buf is None:
        buf = buffers[key] = torch.zeros(pad_to, rows.shape[1], dtype=rows.dtype, device=rows.device)
    buf[:m].copy_(rows)
    return buf, m


def _transposed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pad_to: int = 2) -> torch.Tensor:
    """``x @ W.T (+ b)`` computed as ``(W @ x.T).T`` over at least ``pad_to`` rows (a 1-column
    product would take the slower matrix-vector path). The result is contiguous (a transposed view
    fed to the next linear takes a slow path)."""
    rows, m = _padded(x, pad_to)
    out = torch.mm(weight, rows.contiguous().t()).t()[:m].contiguous()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def mkl_packed_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch has MKL's packed GEMM (x86 builds) for ``dtype`` (fp32 only)."""
    return (dtype == torch.float32 and torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight") and hasattr(torch.ops.mkl, "_mkl_linear"))


def _pack(weight: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)


def _packed(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T (+ b)`` through MKL's packed GEMM over ``packed`` (``weight`` packed for
    :data:`PACK_ROWS` rows), at ``x``'s own row count (at most :data:`PACK_ROWS`)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.mkl._mkl_linear(rows, packed, weight, bias, rows.shape[0])
    return out.reshape(*x.shape[:-1], weight.shape[0])


class PackedWeight:
    """A weight in MKL's packed GEMM layout (packed for :data:`PACK_ROWS` rows), re-packed when
    the weight changes in place or gets new storage (so a routed product never uses stale numbers)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self._key: tuple[int, int] | None = None
        self._packed: torch.Tensor | None = None

    def __deepcopy__(self, memo: dict) -> "PackedWeight":
        """A copy over the copied weight, packed again when first used (MKL's packed tensors
        cannot be copied, so a model with routed linears could not be deep-copied)."""
        return PackedWeight(copy.deepcopy(self.weight, memo))

    def get(self) -> torch.Tensor:
        w = self.weight
        try:
            version = w._version
        except RuntimeError:  # an inference tensor keeps no version counter
            version = -1
        key = (version, w.data_ptr())
        if key != self._key or self._packed is None:
            self._packed, self._key = _pack(w), key
        return self._packed


Route = tuple[str, int]  # (form, rows the product runs at: the transposed form pads)


class LinearDispatch:
    """Routes a linear by its input row count ``m`` to the cheapest calibrated form: ``F.linear``
    at ``m`` rows, ``(W @ x.T).T`` padded to some calibrated ``p >= m`` rows (at least 2), or MKL's
    packed GEMM at ``m`` rows over the weight's packed copy. A weight without a packed copy (the
    Hydra heads') takes the best of the first two forms. Beyond the last calibrated row count,
    ``F.linear``."""

    def __init__(self, timings_ms: Mapping[int, Sequence[float]]) -> None:
        """``timings_ms``: rows -> (``F.linear`` ms, transposed ms[, packed ms]) over all of a
        model's linears (packed: the one copy packed for :data:`PACK_ROWS` rows, at that many
        rows; missing: never routed there)."""
        rows = sorted(int(r) for r in timings_ms)
        if not rows or rows[0] != 1:
            raise ValueError("LinearDispatch needs timings for 1 row")
        if rows[-1] > PACK_ROWS:
            raise ValueError(f"LinearDispatch timings go up to {PACK_ROWS} rows (packed copies serve no more), "
                             f"got {rows[-1]}")
        inf = float("inf")
        self.timings_ms = {r: tuple(float(t) for t in (*timings_ms[r], inf)[:3]) for r in rows}
        self._rows = rows
        self._rowmajor = [self._pick(m, False)[1] for m in range(1, rows[-1] + 1)]  # m - 1 -> route
        self._routes = [self._pick(m, True)[1] for m in range(1, rows[-1] + 1)]  # with a packed copy
        #: Whether any row count takes the packed form (:func:`install` then packs the weights).
        self.packs = any(form == PACKED for form, _ in self._routes)

    def _pick(self, m: int, packed: bool) -> tuple[float, Route]:
        """The cheapest route for ``m`` rows (with a packed copy or not), and its ms: another form
        only where it beats ``F.linear`` by 5%."""
        above = [r for r in self._rows if r >= m]
        t = min(above, key=lambda r: self.timings_ms[r][1])
        plain = self.timings_ms[above[0]][0]
        others = [(self.timings_ms[t][1], (TRANSPOSED, max(t, 2)))]
        if packed:
            others.append((self.timings_ms[above[0]][2], (PACKED, m)))
        ms, route = min(others, key=lambda o: o[0])
        return (ms, route) if ms < 0.95 * plain else (plain, (LINEAR, m))

    def route(self, m: int, packed: bool = True) -> Route:
        """``(form, rows it runs at)`` for ``m`` input rows, for a weight with (``packed``) or
        without a packed copy."""
        table = self._routes if packed else self._rowmajor
        return table[m - 1] if 0 < m <= len(table) else (LINEAR, m)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               packed: PackedWeight | None = None) -> torch.Tensor:
        # the common case first, with the fewest checks: this runs for every linear of a forward
        m = x.numel() // x.shape[-1] if x.dim() >= 2 else 0
        form, rows = self.route(m, packed is not None)
        if form == LINEAR or x.device.type != "cpu":
            return F.linear(x, weight, bias)
        if form == PACKED:
            return _packed(x, weight, packed.get(), bias)
        return _transposed(x, weight, bias, rows)

    def steps(self) -> list[int]:
        """Row counts on either side of each change of route (where a product's cost jumps):
        what a cost model of the forward should time rather than interpolate. The transposed form
        changes route with its padding; the other two run at the row count itself."""
        keys = [(form, rows if form == TRANSPOSED else 0) for form, rows in self._routes]
        return sorted({n for m in range(1, len(keys)) if keys[m] != keys[m - 1] for n in (m, m + 1)})

    @property
    def routes(self) -> bool:
        """Whether any row count takes another form than ``F.linear``."""
        return any(form != LINEAR for form, _ in self._routes)

    def summary(self) -> str:
        parts = []
        for form, label in ((TRANSPOSED, "(W @ x.T).T"), (PACKED, "MKL packed GEMM")):
            rows = [m for m, (f, _) in enumerate(self._routes, 1) if f == form]
            if rows:
                parts.append(f"{label} for rows {_spans(rows)}")
        if self.packs:
            parts.append(f"weights packed once (for {PACK_ROWS} rows)")
        return "; ".join(parts) if parts else "F.linear everywhere"


def _spans(rows: Sequence[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"1-3, 5"``."""
    spans: list[list[int]] = []
    for r in rows:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


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


def cpu_flags() -> set[str]:
    """The x86 feature flags of this CPU (empty where ``/proc/cpuinfo`` has none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (x86 AMX-BF16 or AVX512-BF16, read from
    ``/proc/cpuinfo``); without it bf16 matmuls are emulated and a multi-token verify pass costs
    more than in fp32."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def _fingerprint(linears: Sequence[nn.Linear], rows: Sequence[int]) -> str:
    p = linears[0].weight
    key = json.dumps([_CACHE_VERSION, cpu_name(), torch.__version__, torch.get_num_threads(), str(p.dtype),
                      sorted(tuple(m.weight.shape) for m in linears), list(rows), PACK_ROWS])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _packs_agree(linears: Sequence[nn.Linear], packs: Sequence[torch.Tensor], inputs: Mapping[int, torch.Tensor],
                 rows: Sequence[int]) -> bool:
    """Whether the packed copies reproduce ``F.linear`` (to fp32 rounding) at every row count: MKL
    documents a packed copy for the row count it was packed for; we use it at fewer."""
    seen: set[tuple[int, ...]] = set()
    for lin, packed in zip(linears, packs):
        if tuple(lin.weight.shape) in seen:
            continue
        seen.add(tuple(lin.weight.shape))
        for m in rows:
            x = inputs[lin.in_features][:m]
            want = F.linear(x, lin.weight, lin.bias)
            if not torch.allclose(_packed(x, lin.weight, packed, lin.bias), want, rtol=1e-4,
                                  atol=1e-5 * float(want.abs().max().clamp(min=1.0))):
                return False
    return True


def calibrate(model: nn.Module, rows: Sequence[int] = CALIBRATION_ROWS, repeats: int = 4,
              cache_dir: Path | None = None,
              announce: Callable[[str], ContextManager[None]] | None = None) -> LinearDispatch:
    """Time the three forms over all of ``model``'s linears (each with its own weights, so memory
    traffic is real) at each row count: best of ``repeats`` rounds after a warm-up round, every
    form at every row count within each round, so that a slow spell of the machine hits all of
    them alike. The packed form (fp32 with MKL only) runs over one packed copy of every weight,
    and only where :func:`_packs_agree`. With ``cache_dir``, timings are read from / written to a
    JSON file there keyed by the CPU, torch version, thread count, dtype and linear shapes.
    ``announce(what)`` wraps the timing when it runs (the caller's progress line)."""
    linears = _linears(model)
    if not linears:
        return LinearDispatch({r: (1.0, 1.0) for r in rows})
    path = cache_dir / f"linear-{_fingerprint(linears, rows)}.json" if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            return LinearDispatch({int(r): tuple(ms) for r, ms in json.loads(path.read_text()).items()})
        except (ValueError, TypeError, AttributeError):
            pass  # a damaged cache file is measured again and rewritten
    p = linears[0].weight
    where = f"; cached in {path.parent}" if path is not None else ""
    say = announce or (lambda _: nullcontext())
    with say(f"timing this CPU's linear layers at {len(rows)} row counts (once per machine{where})"), \
            torch.inference_mode():
        inputs = {k: torch.randn(max(rows), k, dtype=p.dtype, device=p.device) for k in {m.in_features for m in linears}}
        packing = p.device.type == "cpu" and mkl_packed_available(p.dtype)
        packs = [_pack(lin.weight) for lin in linears] if packing else []
        if packing and not _packs_agree(linears, packs, inputs, rows):
            packing, packs = False, []

        def run(form: str, m: int) -> float:
            t0 = time.perf_counter()
            for i, lin in enumerate(linears):
                x = inputs[lin.in_features][:m]
                if form == LINEAR:
                    F.linear(x, lin.weight, lin.bias)
                elif form == TRANSPOSED:
                    _transposed(x, lin.weight, lin.bias, 2)
                else:
                    _packed(x, lin.weight, packs[i], lin.bias)
            return (time.perf_counter() - t0) * 1e3

        forms = (LINEAR, TRANSPOSED, PACKED) if packing else (LINEAR, TRANSPOSED)
        best = {m: [float("inf")] * len(forms) for m in rows}
        for rep in range(repeats + 1):  # the first round warms up
            for m in rows:
                for i, form in enumerate(forms):
                    ms = run(form, m)
                    best[m][i] = min(best[m][i], ms) if rep else best[m][i]
        del packs
        timings = {m: [round(t, 3) for t in b] for m, b in best.items()}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(timings))
    return LinearDispatch(timings)


class LinearRouter:
    """The routing the ``nn.Linear`` modules :func:`install` rerouted follow: ``dispatch``, or
    stock ``F.linear`` while it is ``None``. One per model, held and set by its owner."""

    def __init__(self, dispatch: LinearDispatch | None = None) -> None:
        self.dispatch = dispatch

    @contextmanager
    def using(self, dispatch: LinearDispatch | None) -> Iterator[None]:
        """Within this block the router's linears take ``dispatch``; the outer one after."""
        outer, self.dispatch = self.dispatch, dispatch
        try:
            yield
        finally:
            self.dispatch = outer

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               packed: PackedWeight | None = None) -> torch.Tensor:
        """``F.linear`` routed by the current dispatch (a product no module holds: the heads' LM head)."""
        d = self.dispatch
        return d.linear(x, weight, bias, packed) if d is not None else F.linear(x, weight, bias)


def _routed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    dispatch = self._dyntree_router.dispatch  # :meth:`LinearRouter.linear` inlined: one frame less per call
    if dispatch is None:
        return F.linear(x, self.weight, self.bias)
    return dispatch.linear(x, self.weight, self.bias, self._dyntree_packed)


def install(module: nn.Module, router: LinearRouter, packed: bool = False) -> nn.Module:
    """Route ``module``'s ``nn.Linear`` calls through ``router`` (a module installed before takes
    the new router); with ``packed`` (a dispatch's :attr:`LinearDispatch.packs`), each also gets a
    packed copy of its weight (one more copy of the weights in memory, made at the first call that
    needs it). Returns ``module``."""
    for lin in _linears(module):
        lin.forward = types.MethodType(_routed_forward, lin)
        lin._dyntree_router = router  # a plain attribute: in the module's __dict__, found without __getattr__
        if packed:
            lin._dyntree_packed = PackedWeight(lin.weight)
        else:  # set, not looked up with a default: a missing module attribute raises inside
            lin.__dict__.setdefault("_dyntree_packed", None)  # nn.Module.__getattr__ (slow per call)
    return module

