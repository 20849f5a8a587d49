"""GPU benchmark: the Triton W4A16 kernel vs a bf16 torch matmul at Llama-3-8B layer shapes.

For every linear layer shape of Llama-3-8B (q/o: 4096->4096, k/v: 4096->1024, gate/up:
4096->14336, down: 14336->4096) and M = 1..16 tokens, times ``x @ W.T`` in bf16 (cuBLAS) and
``w4a16_matmul`` (int4 symmetric, group 128, fp16 scales) with its default launch and the best of
a small config sweep, checks the kernel against the torch reference, and reports achieved
bandwidth (weight + activation + output bytes / time). Weights are random (timing does not
depend on values). Writes JSON to ``benchmarks/results/w4a16/<gpu>.json``.

    python benchmarks/w4a16.py [--m 1 2 4 8 16] [--out PATH]

Needs a CUDA GPU and Triton; exits with a clear message otherwise.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from dyntree.common.quant import quantize_weight
from dyntree.kernels.w4a16 import HAS_TRITON, W4A16Config, default_config, w4a16_matmul, w4a16_matmul_reference
from dyntree.models import machine_kind
from results_index import result_path  # benchmarks/ is on sys.path when run as a script

LAYERS = {  # name: (K = in_features, N = out_features)
    "q_proj/o_proj": (4096, 4096),
    "k_proj/v_proj": (4096, 1024),
    "gate_proj/up_proj": (4096, 14336),
    "down_proj": (14336, 4096),
}
GROUP = 128
SWEEP = [
    W4A16Config(block_m=16, block_n=bn, block_k=bk, split_k=sk, num_warps=nw, num_stages=ns)
    for bn in (32, 64, 128)
    for bk in (64, 128)
    for sk in (1, 2, 4, 8)
    for nw in (4,)
    for ns in (2, 4)
]


def _time_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _bench_shape(name: str, k: int, n: int, m: int, sweep: bool) -> dict:
    dev = "cuda"
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    qw = quantize_weight(w, 4, GROUP, symmetric=True, scale_dtype=torch.float16)
    packed, scales = qw.qweight, qw.scales

    ref = w4a16_matmul_reference(x, packed, scales, None, GROUP).float()
    y = w4a16_matmul(x, packed, scales, None, GROUP).float()
    rel_err = ((y - ref).norm() / ref.norm()).item()

    t_bf16 = _time_ms(lambda: x @ w.t())
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    cfg = default_config(m, n, k, GROUP, sms)
    t_default = _time_ms(lambda: w4a16_matmul(x, packed, scales, None, GROUP, cfg))
    best_cfg, t_best = cfg, t_default
    if sweep:
        for c in SWEEP:
            if GROUP % c.block_k:
                continue
            t = _time_ms(lambda c=c: w4a16_matmul(x, packed, scales, None, GROUP, c))
            if t < t_best:
                best_cfg, t_best = c, t

    act_bytes = m * k * 2 + m * n * 2
    bytes_bf16 = n * k * 2 + act_bytes
    bytes_w4 = qw.nbytes + act_bytes
    return {
        "layer": name,
        "K": k,
        "N": n,
        "M": m,
        "bf16_ms": t_bf16,
        "w4a16_default_ms": t_default,
        "w4a16_best_ms": t_best,
        "speedup_default": t_bf16 / t_default,
        "speedup_best": t_bf16 / t_best,
        "bf16_GBps": bytes_bf16 / t_bf16 / 1e6,
        "w4a16_best_GBps": bytes_w4 / t_best / 1e6,
        "weight_bytes_bf16": n * k * 2,
        "weight_bytes_w4": qw.nbytes,
        "default_config": asdict(cfg),
        "best_config": asdict(best_cfg),
        "rel_err_vs_reference": rel_err,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="tokens per matmul (1..16)")
    ap.add_argument("--no-sweep", action="store_true", help="time only the default launch config")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/w4a16/<gpu>.json)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/w4a16.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured.",
              file=sys.stderr)
        return 2
    if not HAS_TRITON:
        print("benchmarks/w4a16.py needs triton (pip install triton).", file=sys.stderr)
        return 2
    bad = [m for m in args.m if not 1 <= m <= 16]
    if bad:
        ap.error(f"--m values must lie in 1..16, got {bad}")
    import triton

    torch.manual_seed(0)
    rows = []
    for name, (k, n) in LAYERS.items():
        for m in args.m:
            row = _bench_shape(name, k, n, m, sweep=not args.no_sweep)
            rows.append(row)
            print(
                f"{name:18s} K={k:5d} N={n:5d} M={m:2d}  bf16 {row['bf16_ms'] * 1e3:7.1f} us  "
                f"w4a16 {row['w4a16_default_ms'] * 1e3:7.1f} us (best {row['w4a16_best_ms'] * 1e3:7.1f})  "
                f"x{row['speedup_best']:.2f}  {row['w4a16_best_GBps']:.0f} GB/s  rel.err {row['rel_err_vs_reference']:.1e}",
                flush=True,
            )
    gpu = torch.cuda.get_device_name()
    result = {
        "benchmark": "w4a16_matmul vs bf16 torch matmul, Llama-3-8B linear shapes",
        "device": gpu,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
        },
        "weights": f"int4 symmetric, group {GROUP}, fp16 scales; random values",
        "timing": "triton.testing.do_bench median (ms), L2 flushed between runs",
        "bandwidth": "bytes read+written (weights incl. scales, x, y) / time, GB/s",
        "rows": rows,
    }
    out = args.out or result_path("w4a16", machine_kind(torch.device("cuda")))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
