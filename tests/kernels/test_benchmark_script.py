"""benchmarks/kernels.py imports without a GPU, parses its flags and refuses clearly without CUDA."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"


def _load():
    spec = importlib.util.spec_from_file_location("dyntree_bench_kernels", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="this checks the no-CUDA path")
def test_benchmark_refuses_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _load()
    assert bench.main(["--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    assert "--sweep" in capsys.readouterr().out


def test_benchmark_case_runs_on_cpu_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-case path (our kernel, chain mode, SDPA over gathered KV) on tiny shapes."""
    import argparse
    import time

    from dyntree.kernels._triton import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    bench = _load()
    monkeypatch.setattr(bench, "LLAMA3_8B", dict(num_q_heads=4, num_kv_heads=2, head_dim=64))

    def once(fn) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    monkeypatch.setattr(bench, "bench", once)
    case = bench.Case(2, 21, 5, 4, torch.float32, seed=0, device="cpu")
    row = bench.run_case(case, argparse.Namespace(sweep=False, no_flex=True), peak=100.0)
    assert row["max_abs_err_vs_sdpa"] < 1e-4
    assert row["tree_ms"] > 0 and row["chain_ms"] > 0 and row["sdpa_ms"] > 0 and row["sdpa_with_gather_ms"] > 0
    assert row["kv_bytes"] == 2 * 26 * 2 * 64 * 2 * 4 + 2 * 10 * 4 * 64 * 4
