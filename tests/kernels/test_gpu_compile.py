"""The Triton kernels compile for sm_90 through ptxas without register spills (no GPU needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dyntree.kernels._triton import HAS_TRITON, triton


def _has_nvidia_backend() -> bool:
    return HAS_TRITON and (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.skipif(not _has_nvidia_backend(), reason="triton with its NVIDIA backend (ptxas) is not installed")
def test_kernels_compile_for_sm90() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    script = Path(__file__).with_name("_sm90_compile.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("REG:") == 8, proc.stdout
