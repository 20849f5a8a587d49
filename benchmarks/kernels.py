"""GPU benchmark of the dyntree tree-verify kernels (needs CUDA; exits with a message otherwise).

Paged tree attention on Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128,
vLLM layout, block size 16) against:

* ``chain``: the same kernel on a plain causal chain of equal token count (plain paged attention
  with the same number of query tokens; target: tree <= 1.05x chain);
* ``sdpa``: PyTorch SDPA with an explicit bool mask over K/V gathered from the paged cache
  (timed with and without the gather);
* ``flex``: FlexAttention (compiled) with a tree block mask over the gathered K/V.

Achieved HBM bandwidth counts the K/V bytes each request must read plus q and output, against
the device's peak (target: >= 70% for prefixes >= 4k). It also times greedy tree accept and KV
compaction. Results go to ``benchmarks/results/kernels/<gpu>[_quick].json``.

    python benchmarks/kernels.py --quick            # a few minutes
    python benchmarks/kernels.py                    # full grid: batch 1..64, prefix 512..32k, trees 16..128
    python benchmarks/kernels.py --sweep            # also tune tile configs per case
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from dyntree.common.tree import DraftTree, TreeBatch
from dyntree.models import machine_kind
from results_index import result_path  # benchmarks/ is on sys.path when run as a script

LLAMA3_8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
# Peak HBM bandwidth (GB/s) by device-name fragment, used when the driver does not report clocks.
PEAK_GBPS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 NVL": 3900.0, "H100 PCIe": 2000.0, "H100": 3350.0,
             "A100-SXM4-80GB": 2039.0, "A100 80GB PCIe": 1935.0, "A100": 1555.0, "L40S": 864.0, "L4": 300.0,
             "B200": 8000.0, "RTX 4090": 1008.0, "A10G": 600.0}
SWEEP = [(64, 32, 4, 2), (64, 64, 4, 2), (64, 32, 4, 3), (32, 64, 4, 3), (64, 64, 8, 3), (128, 32, 8, 2)]


def peak_gbps(override: float | None) -> tuple[float, str]:
    if override:
        return override, "--peak-gbps"
    props = torch.cuda.get_device_properties(0)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, "memory_clock_rate x bus width x 2"
    for key, value in PEAK_GBPS.items():
        if key in props.name:
            return value, f"table entry {key!r}"
    raise SystemExit(f"unknown peak bandwidth for {props.name!r}: pass --peak-gbps")


def random_tree(gen: torch.Generator, size: int) -> DraftTree:
    """A random recursive tree (each node's parent uniform over earlier nodes)."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, size)]
    return DraftTree(torch.zeros(size, dtype=torch.int64), torch.tensor(parents), torch.ones(size))


class Case:
    """One (batch, prefix, tree size) problem in vLLM's paged layout, plus gathered copies."""

    def __init__(
        self, batch: int, prefix: int, nodes: int, block_size: int, dtype: torch.dtype, seed: int, device: str = "cuda"
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        hq, hkv, d = LLAMA3_8B["num_q_heads"], LLAMA3_8B["num_kv_heads"], LLAMA3_8B["head_dim"]
        self.batch, self.prefix, self.nodes = batch, prefix, nodes
        seq = prefix + nodes
        blocks = math.ceil(seq / block_size)
        self.device = dev = device
        self.kv_cache = torch.randn(2, batch * blocks, block_size, hkv, d, device=dev, dtype=dtype)
        perm = torch.randperm(batch * blocks, generator=gen).to(torch.int32)
        self.block_table = perm.view(batch, blocks).to(dev)
        self.seq_lens = torch.full((batch,), seq, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(0, (batch + 1) * nodes, nodes, dtype=torch.int32, device=dev)
        self.q = torch.randn(batch * nodes, hq, d, device=dev, dtype=dtype)
        trees = [random_tree(gen, nodes) for _ in range(batch)]
        self.mask = TreeBatch.from_trees(trees).mask.to(dev)
        from dyntree.kernels import pack_ancestor_bits

        self.tree_bits = pack_ancestor_bits(self.mask)
        self.scale = d**-0.5
        self.seq = seq
        elem = torch.finfo(dtype).bits // 8
        self.bytes = batch * seq * hkv * d * 2 * elem + 2 * self.q.numel() * elem

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V gathered into contiguous ``[B, Hkv, S, D]`` (what SDPA/Flex need)."""
        bs = self.kv_cache.shape[2]
        pos = torch.arange(self.seq, device=self.device)
        pages = self.block_table[:, pos // bs].long()
        k = self.kv_cache[0][pages, pos % bs]  # [B, S, Hkv, D]
        v = self.kv_cache[1][pages, pos % bs]
        return k.transpose(1, 2), v.transpose(1, 2)

    def dense_mask(self) -> torch.Tensor:
        m = torch.ones(self.batch, 1, self.nodes, self.seq, dtype=torch.bool, device=self.device)
        m[:, 0, :, self.prefix :] = self.mask
        return m


def bench(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def run_case(case: Case, args: argparse.Namespace, peak: float) -> dict[str, Any]:
    from dyntree.kernels.tree_attention import paged_tree_attention_triton

    k_cache, v_cache = case.kv_cache[0], case.kv_cache[1]
    common = (case.q, k_cache, v_cache, case.block_table, case.seq_lens, case.query_start_loc)

    def ours(bits: torch.Tensor | None, cfg: tuple[int, int, int, int] | None) -> Callable[[], torch.Tensor]:
        kw = {} if cfg is None else dict(block_m=cfg[0], block_n=cfg[1], num_warps=cfg[2], num_stages=cfg[3])
        return lambda: paged_tree_attention_triton(
            *common, bits, case.scale, max_query_len=case.nodes, max_seq_len=case.seq, **kw
        )

    row: dict[str, Any] = dict(batch=case.batch, prefix=case.prefix, tree_nodes=case.nodes, kv_bytes=case.bytes)
    configs: list[tuple[int, int, int, int] | None] = [None] + (SWEEP if args.sweep else [])
    best: tuple[float, Any] | None = None
    for cfg in configs:
        try:
            t = bench(ours(case.tree_bits, cfg))
        except Exception as e:  # a tile config can exceed shared memory on smaller GPUs
            row.setdefault("sweep_errors", []).append(f"{cfg}: {type(e).__name__}")
            continue
        if best is None or t < best[0]:
            best = (t, cfg)
    assert best is not None, row.get("sweep_errors")
    row["config"] = "default" if best[1] is None else list(best[1])
    row["tree_ms"] = best[0]
    row["chain_ms"] = bench(ours(None, best[1]))
    row["tree_over_chain"] = row["tree_ms"] / row["chain_ms"]
    row["tree_gbps"] = case.bytes / (row["tree_ms"] * 1e-3) / 1e9
    row["tree_frac_peak"] = row["tree_gbps"] / peak
    out = ours(case.tree_bits, best[1])()

    try:
        k, v = case.gathered()
        mask = case.dense_mask()
        qd = case.q.view(case.batch, case.nodes, *case.q.shape[1:]).transpose(1, 2)
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            qd, k, v, attn_mask=mask, scale=case.scale, enable_gqa=True
        )
        ref = sdpa().transpose(1, 2).reshape_as(case.q)
        row["max_abs_err_vs_sdpa"] = float((out.float() - ref.float()).abs().max())
        row["sdpa_ms"] = bench(sdpa)

        def gather_then_sdpa() -> torch.Tensor:
            k2, v2 = case.gathered()
            return torch.nn.functional.scaled_dot_product_attention(
                qd, k2, v2, attn_mask=mask, scale=case.scale, enable_gqa=True
            )

        row["sdpa_with_gather_ms"] = bench(gather_then_sdpa)
        del mask
    except torch.OutOfMemoryError:
        row["sdpa_ms"] = "oom"
        k = v = None
    if not args.no_flex and k is not None:
        row["flex_ms"] = flex_time(case, k, v)
    if case.device == "cuda":
        torch.cuda.empty_cache()
    return row


_FLEX: dict[str, Any] = {}


def flex_time(case: Case, k: torch.Tensor, v: torch.Tensor) -> float | str:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if "fn" not in _FLEX:
            _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
        bits, prefix, nodes = case.tree_bits, case.prefix, case.nodes

        def tree_mask(b, h, q_idx, kv_idx):
            j = (kv_idx - prefix).clamp(0, nodes - 1)
            word = bits[b, q_idx, j // 32]
            return (kv_idx < prefix) | ((((word >> (j % 32)) & 1) == 1) & (kv_idx >= prefix))

        block_mask = create_block_mask(tree_mask, case.batch, None, nodes, case.seq, device=case.device)
        qd = case.q.view(case.batch, nodes, *case.q.shape[1:]).transpose(1, 2)
        fn = lambda: _FLEX["fn"](qd, k, v, block_mask=block_mask, scale=case.scale, enable_gqa=True)  # noqa: E731
        fn()
        return bench(fn)
    except Exception as e:  # record why Flex could not run this shape instead of aborting the sweep
        return f"error: {type(e).__name__}: {str(e)[:200]}"


def accept_and_compact(dtype: torch.dtype) -> dict[str, Any]:
    """Greedy tree accept (B=64, T=128) and one layer of KV compaction (B=64, paths of 8)."""
    from dyntree.kernels import kv_compact_vllm, tree_accept_greedy

    gen = torch.Generator().manual_seed(0)
    batch = TreeBatch.from_trees([random_tree(gen, 128) for _ in range(64)])
    tokens = torch.randint(0, 4, (64, 128), device="cuda")
    parents = batch.parents.cuda()
    top = torch.randint(0, 4, (64, 128), device="cuda")
    res: dict[str, Any] = {"greedy_accept_b64_t128_ms": bench(lambda: tree_accept_greedy(tokens, parents, top))}
    kv = torch.randn(2, 64 * 130, 16, 8, 128, device="cuda", dtype=dtype)
    table = torch.arange(64 * 130, dtype=torch.int32, device="cuda").view(64, 130)
    prefix = torch.full((64,), 2000, dtype=torch.int32, device="cuda")
    index = torch.arange(8, device="cuda").repeat(64, 1) * 3
    index[:, 0] = 0
    lens = torch.full((64,), 8, dtype=torch.int64, device="cuda")
    res["kv_compact_b64_path8_one_layer_ms"] = bench(lambda: kv_compact_vllm(kv, table, prefix, index, lens))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small grid: batch {1,16}, prefix {512,8192}, trees {16,64}")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--prefix", type=int, nargs="+", default=[512, 4096, 32768])
    ap.add_argument("--tree-nodes", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    ap.add_argument("--block-size", type=int, default=16, help="vLLM KV block size")
    ap.add_argument("--sweep", action="store_true", help="try several tile configs per case, keep the fastest")
    ap.add_argument("--no-flex", action="store_true", help="skip the FlexAttention baseline")
    ap.add_argument("--peak-gbps", type=float, default=None, help="override the device's peak HBM bandwidth")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/kernels/<gpu>[_quick].json)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU: torch.cuda.is_available() is False on this machine.", file=sys.stderr)
        return 2
    try:
        import triton
    except ImportError:
        print("benchmarks/kernels.py needs triton (pip install 'dyntree-spec[triton]').", file=sys.stderr)
        return 2
    if args.quick:
        args.batch, args.prefix, args.tree_nodes = [1, 16], [512, 8192], [16, 64]
    dtype = getattr(torch, args.dtype)
    peak, peak_source = peak_gbps(args.peak_gbps)
    name = torch.cuda.get_device_name(0)
    rows = []
    for b in args.batch:
        for p in args.prefix:
            for n in args.tree_nodes:
                row = run_case(Case(b, p, n, args.block_size, dtype, seed=b * 7 + p + n), args, peak)
                rows.append(row)
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
                torch.cuda.empty_cache()
    long_rows = [r for r in rows if r["prefix"] >= 4096]
    summary = {
        "max_tree_over_chain": max(r["tree_over_chain"] for r in rows),
        "tree_over_chain_target": 1.05,
        "min_frac_peak_prefix_ge_4k": min((r["tree_frac_peak"] for r in long_rows), default=None),
        "frac_peak_target": 0.70,
    }
    summary["meets_tree_over_chain"] = summary["max_tree_over_chain"] <= 1.05
    summary["meets_bandwidth"] = summary["min_frac_peak_prefix_ge_4k"] is not None and summary["min_frac_peak_prefix_ge_4k"] >= 0.70
    report = {
        "device": name,
        "peak_hbm_gbps": peak,
        "peak_source": peak_source,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                     "python": platform.python_version()},
        "shapes": dict(LLAMA3_8B, dtype=args.dtype, kv_layout="vllm [2, num_blocks, block_size, Hkv, D]",
                       block_size=args.block_size),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "results": rows,
        "accept_and_compact": accept_and_compact(dtype),
        "summary": summary,
    }
    out = args.out or result_path("kernels", machine_kind(torch.device("cuda")), setting="quick" if args.quick else None)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(summary, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
