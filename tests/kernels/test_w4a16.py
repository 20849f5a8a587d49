"""The Triton W4A16 kernel against its torch reference (Triton interpreter on CPU, fp32/fp16)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():  # must be set before the kernel is decorated (module import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dyntree.common.quant import QuantizedWeight, dequantize_weight, quantize_weight  # noqa: E402
from dyntree.kernels.w4a16 import (  # noqa: E402
    HAS_TRITON,
    W4A16Config,
    default_config,
    kernel_supports,
    w4a16_matmul,
    w4a16_matmul_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def _case(m: int, n: int, k: int, group: int | None, symmetric: bool, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.1
    x = torch.randn(m, k, generator=gen).to(dtype)
    qw = quantize_weight(w, 4, group, symmetric)
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return x.to(DEVICE), to(qw.qweight), to(qw.scales), to(qw.zeros), qw


def _tolerance(x: torch.Tensor, qw: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """Elementwise bound: relative error of the operand/output dtype times sum |x||w|."""
    mag = x.float().abs().cpu() @ dequantize_weight(qw).abs().t()
    eps = 1e-5 if dtype == torch.float32 else 2e-3
    return eps * mag + 1e-6


def test_reference_is_dequantize_then_matmul() -> None:
    x, packed, scales, zeros, qw = _case(3, 24, 77, 32, False, torch.float32, 0)
    expected = x.cpu() @ dequantize_weight(qw).t()
    torch.testing.assert_close(w4a16_matmul_reference(x, packed, scales, zeros, 32).cpu(), expected)


@needs_triton
@settings(max_examples=12, deadline=None)
@given(
    m=st.integers(1, 20),
    n=st.integers(1, 80),
    k=st.integers(1, 300),
    group=st.sampled_from([32, 64, 128, None]),
    symmetric=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    split_k=st.sampled_from([1, 3]),
    seed=st.integers(0, 1000),
)
def test_kernel_matches_reference(
    m: int, n: int, k: int, group: int | None, symmetric: bool, dtype: torch.dtype, split_k: int, seed: int
) -> None:
    x, packed, scales, zeros, qw = _case(m, n, k, group, symmetric, dtype, seed)
    g = qw.group_size
    base = default_config(m, n, k, g)
    config = W4A16Config(block_m=base.block_m, block_n=32, block_k=min(base.block_k, 64), split_k=split_k)
    y = w4a16_matmul(x, packed, scales, zeros, g, config)
    ref = w4a16_matmul_reference(x, packed, scales, zeros, g)
    assert y.shape == (m, n) and y.dtype == dtype
    err = (y.float() - ref.float()).abs().cpu()
    assert bool((err <= _tolerance(x, qw, dtype)).all()), f"max err {err.max().item():.3e}"


@needs_triton
def test_kernel_default_config_and_bf16_input() -> None:
    # default launch (block_k 128 inside group 128, ragged last group: K=200) and bf16 input,
    # which the interpreter computes with fp32 dots
    for dtype in (torch.float16, torch.bfloat16):
        x, packed, scales, zeros, qw = _case(2, 48, 200, 128, True, dtype, 5)
        y = w4a16_matmul(x, packed, scales, zeros, 128)
        ref = w4a16_matmul_reference(x, packed, scales, zeros, 128)
        assert y.dtype == dtype
        tol = _tolerance(x, qw, torch.float16) * (4 if dtype == torch.bfloat16 else 1)
        assert bool(((y.float() - ref.float()).abs().cpu() <= tol).all())


def test_default_config_splits_k_to_fill_the_gpu() -> None:
    cfg = default_config(1, 4096, 4096, 128, sm_count=132)  # 64 output tiles
    tiles = 4096 // cfg.block_n
    assert cfg.block_k == 128 and tiles * cfg.split_k >= 2 * 132 and cfg.split_k <= 4096 // 128
    assert default_config(1, 4096, 4096, 128, sm_count=1).split_k == 1
    assert default_config(1, 64, 64, 32).block_k == 32
    assert default_config(16, 64, 100, 128).block_k == 128  # one group spans K
    assert default_config(40, 64, 256, 128).block_m == 64
    assert not kernel_supports(100, 48) and kernel_supports(40, 48) and kernel_supports(256, 96)
    with pytest.raises(ValueError, match="group_size must be a multiple of 32"):
        default_config(1, 8, 100, 48)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"x": torch.zeros(4)}, "x must be 2-D"),
        ({"packed": torch.zeros(8, 10, dtype=torch.uint8)}, r"packed must be uint8 \[N, ceil\(K/2\)\]"),
        ({"packed": torch.zeros(8, 32, dtype=torch.int32)}, "packed must be uint8"),
        ({"scales": torch.ones(8, 3)}, r"scales must be \[N, ceil\(K/group\)\] = \[8, 2\]"),
        ({"zeros": torch.ones(8, 1)}, "zeros must match scales"),
        ({"group": 0}, "group_size must be positive"),
    ],
)
def test_bad_inputs_are_rejected_with_the_field_named(change: dict, match: str) -> None:
    args = {
        "x": torch.zeros(2, 64),
        "packed": torch.zeros(8, 32, dtype=torch.uint8),
        "scales": torch.ones(8, 2),
        "zeros": None,
        "group": 32,
    }
    args.update(change)
    with pytest.raises(ValueError, match=match):
        w4a16_matmul_reference(args["x"], args["packed"], args["scales"], args["zeros"], args["group"])


@needs_triton
def test_kernel_rejects_block_k_that_straddles_groups() -> None:
    x, packed, scales, zeros, _ = _case(1, 8, 128, 32, True, torch.float32, 0)
    with pytest.raises(ValueError, match="block_k=64 must be a multiple of 32 dividing group_size=32"):
        w4a16_matmul(x, packed, scales, zeros, 32, W4A16Config(block_k=64))


def test_module_imports_and_reference_runs_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "import torch\n"
        "from dyntree.common.quant import quantize_weight\n"
        "from dyntree.kernels import w4a16\n"
        "assert not w4a16.HAS_TRITON\n"
        "qw = quantize_weight(torch.randn(4, 64), 4, 32)\n"
        "x = torch.randn(2, 64)\n"
        "assert w4a16.w4a16_matmul_reference(x, qw.qweight, qw.scales, None, 32).shape == (2, 4)\n"
        "try:\n"
        "    w4a16.w4a16_matmul(x, qw.qweight, qw.scales, None, 32)\n"
        "except RuntimeError as e:\n"
        "    assert 'needs triton' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no error without triton')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
