"""The CLI refuses bad input with a one-line error naming the problem (exit code 2), before any
model is loaded."""

from __future__ import annotations

import pytest
import torch

from dyntree.cli import main
from dyntree.models import resolve_device


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--drafter", "qspec:w5a16"], "qspec"),
        (["--drafter", "nosuch"], "nosuch"),
        (["--tree-options", '{"bogus": 1}'], "invalid option tree_options.bogus"),
        (["--tree-options", "[1]"], "--tree-options must be a JSON object"),
        (["--controller-options", '{"min_gain": 0.5}'], "invalid option controller.min_gain"),
        (["--device", "tpu"], "device must be auto, cpu, cuda or cuda:N"),
    ],
)
def test_generate_refuses_bad_input(argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dyntree.models.load_model", lambda *a, **k: pytest.fail("the model must not be loaded"))
    assert main(["generate", "hi", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dyntree: error:") and message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_missing_gpu_is_refused_before_the_model_loads(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dyntree.models.load_model", lambda *a, **k: pytest.fail("the model must not be loaded"))
    assert main(["generate", "hi", "--device", "cuda"]) == 2
    assert "torch sees no CUDA GPU" in capsys.readouterr().err


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="cuda:N"):
        resolve_device("cuda:x")
