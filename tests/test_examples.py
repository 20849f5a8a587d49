"""The scripts in ``examples/`` run as a user would run them: the standalone Python API on the real
model (its output equals plain decoding), and vLLM offline inference where vLLM is installed (under
CI it must be). ``vllm_serve.sh`` and ``openai_client.py`` run in the vLLM serve test."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_generate_example_equals_plain_decoding(smol, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    example = _load("generate")
    monkeypatch.setattr(example, "load_model", lambda *a, **k: smol)
    prompt = "Name three uses of a binary search tree."
    hydra = example.main(prompt, "hydra", 32)
    assert "tokens/s, tau " in capsys.readouterr().out
    assert hydra == example.main(prompt, "none", 32)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM and not os.environ.get("CI"), reason="vLLM is not installed")
def test_vllm_offline_example_runs() -> None:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, str(EXAMPLES / "vllm_offline.py"), "--max-tokens", "24"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("---") == 2 and "vllm:spec_decode_num_drafts" in proc.stdout
