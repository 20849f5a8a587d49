"""The CLI: bad input is refused with one line naming the flag (exit code 2, no traceback) before
any model is loaded; ``generate`` streams its text and ends with a summary, and ``--compare``
checks the output against plain decoding on the real model."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch

from dyntree.cli import main
from dyntree.models import pick_dtype, resolve_device
from dyntree.standalone.stream import TextStream


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dyntree.models.load_model", lambda *a, **k: pytest.fail("the model must not be loaded"))
    monkeypatch.setattr("dyntree.models.model_path", lambda *a, **k: pytest.fail("the model must not be fetched"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--drafter", "qspec:w5a16"], "--drafter: "),
        (["--drafter", "nosuch"], "--drafter: unknown drafter 'nosuch'"),
        (["--drafter", "none:foo=1"], "--drafter: drafter 'none' takes no options"),
        (["--tree-options", '{"bogus": 1}'], "--tree-options: unknown field 'bogus'"),
        (["--tree-options", "[1]"], "--tree-options: must be a JSON object"),
        (["--tree-options", '{"threshold": '], "--tree-options: not valid JSON"),
        (["--controller-options", '{"min_gain": 0.5}'], "--controller-options: min_gain input should be"),
        (["--device", "tpu"], "--device: device must be auto, cpu, cuda or cuda:N"),
        (["--dtype", "fp8"], "--dtype: dtype must be auto, fp32, bf16 or fp16"),
        (["--seed", "99999999999999999999"], "--seed: input should be less than 9223372036854775808"),
        (["--seed", "-1"], "--seed: input should be greater than or equal to 0"),
        (["--top-p", "2"], "--top-p: input should be less than or equal to 1"),
        (["--max-new-tokens", "0"], "--max-new-tokens: input should be greater than or equal to 1"),
        (["--max-nodes", "999"], "--max-nodes: input should be less than or equal to 256"),
        (["--model", "/nonexistent/dir"], "--model: '/nonexistent/dir': no such directory"),
        (["--model", "./relative/nope"], "--model: './relative/nope': no such directory"),
    ],
)
def test_generate_refuses_bad_input(argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
                                    no_model: None) -> None:
    assert main(["generate", "hi", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dyntree: error: ") and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_model_directory_without_config_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   no_model: None) -> None:
    assert main(["generate", "hi", "--model", str(tmp_path)]) == 2
    assert "--model: " in (err := capsys.readouterr().err) and "without a config.json" in err


def test_empty_prompt_is_refused(capsys: pytest.CaptureFixture[str], no_model: None) -> None:
    assert main(["generate", "  "]) == 2
    assert "dyntree: error: PROMPT is empty" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--threads", "-2"], ["--threads", "two"]])
def test_argparse_checks_name_the_flag(argv: list[str], capsys: pytest.CaptureFixture[str], no_model: None) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["generate", "hi", *argv])
    assert exc.value.code == 2
    assert "argument --threads:" in capsys.readouterr().err


def test_model_path_names_its_argument(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model-path", "/nonexistent/dir"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dyntree: error: MODEL: ") and "--model" not in err


def test_bench_checks_modes_and_prompts_before_loading(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       no_model: None) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "hi"}\n')
    assert main(["bench", "--prompts", str(good), "--out", str(tmp_path / "r.json"), "--modes", "none,bogus"]) == 2
    assert "--modes: unknown mode(s) bogus" in capsys.readouterr().err
    assert main(["bench", "--prompts", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "r.json")]) == 2
    assert "--prompts: prompt file" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi"}\n{"prompt": "a\tb"}\n')  # a raw tab inside a JSON string
    assert main(["bench", "--prompts", str(bad), "--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert f"--prompts: {bad}:2: not valid JSON (Invalid control character at column" in err
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    assert main(["bench", "--prompts", str(tmp_path / "list.jsonl"), "--out", str(tmp_path / "r.json")]) == 2
    assert "list.jsonl:1: a prompt line must be a JSON object" in capsys.readouterr().err
    several = ["--drafter", "ngram", "--drafter", "nosuch"]
    assert main(["bench", "--prompts", str(good), "--out", str(tmp_path / "r.json"), *several]) == 2
    assert "--drafter: unknown drafter 'nosuch'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--prompts", str(good), "--out", str(tmp_path / "r.json"), "--repeats", "0"])
    assert "--repeats: must be an integer >= 1, got 0" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from dyntree import __version__

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"dyntree-spec {__version__}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_missing_gpu_is_refused_before_the_model_loads(capsys: pytest.CaptureFixture[str], no_model: None) -> None:
    assert main(["generate", "hi", "--device", "cuda"]) == 2
    assert "--device: device 'cuda' asked for, but torch sees no CUDA GPU" in capsys.readouterr().err


def test_resolve_device_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="cuda:N"):
        resolve_device("cuda:x")
    cpu = torch.device("cpu")
    assert pick_dtype("fp32", cpu) == (torch.float32, "as asked")
    monkeypatch.setattr("dyntree.models.cpu_has_native_bf16", lambda: True)
    assert pick_dtype("auto", cpu)[0] == torch.bfloat16
    monkeypatch.setattr("dyntree.models.cpu_has_native_bf16", lambda: False)
    assert pick_dtype("auto", cpu) == (torch.float32, "auto: this CPU has no native bf16")


class _ByteTokenizer:
    """Token i is byte i (UTF-8 may split a character across tokens), like a byte-level BPE."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def _stream(text: str, stop: tuple[str, ...], run: int) -> tuple[list[str], str]:
    data = list(text.encode())
    s = TextStream(_ByteTokenizer(), stop)
    pieces = [s.push(data[i : i + run]) for i in range(0, len(data), run)]
    return pieces, "".join(pieces) + s.finish()


@pytest.mark.parametrize("run", [1, 2, 3, 7])
def test_text_stream_never_takes_back_what_it_printed(run: int) -> None:
    text = "naïve café — 日本語 ok"
    pieces, whole = _stream(text, (), run)
    assert whole == text and all("\ufffd" not in p for p in pieces)
    pieces, whole = _stream(text + " STOP and more", ("STOP",), run)
    assert whole == text + " " and all("S" not in p for p in pieces)
    _, whole = _stream("no stop here, ST", ("STOP",), run)
    assert whole == "no stop here, ST"  # the held-back tail is released at the end


def test_drafter_defaults_to_auto_and_the_summary_says_what_it_picked() -> None:
    from transformers import AutoTokenizer

    from dyntree.cli import _build_parser, _drafter_note
    from dyntree.common.drafters import check_drafter_spec
    from dyntree.models import model_path
    from dyntree.standalone.target import resolve_hf_drafter
    from spec_support import tiny_llama

    assert _build_parser().parse_args(["generate", "x"]).drafter == "auto"
    check_drafter_spec("auto")  # checked before any model loads, like every other spec
    tok = AutoTokenizer.from_pretrained(model_path("smollm2"))
    assert resolve_hf_drafter("auto", tiny_llama(), tok)[1] == "ngram"  # the shipped heads do not fit it
    assert _drafter_note("auto", "hydra") == "hydra (auto: the shipped heads fit this model)"
    assert _drafter_note("auto", "ngram") == "ngram (auto: no shipped Hydra heads fit this model)"
    assert _drafter_note("ngram", "ngram") == "ngram"


def test_progress_lines_go_to_stderr_with_their_time(capsys: pytest.CaptureFixture[str]) -> None:
    from dyntree import progress

    with progress.step("timing something"):
        pass
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "[dyntree] timing something ..." and err[1].startswith("[dyntree] ... done in ")


@pytest.mark.slow
def test_generate_streams_and_compares_on_the_real_model(smol, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    writes: list[str] = []

    class Counting(io.StringIO):
        def write(self, s: str) -> int:
            if s:
                writes.append(s)
            return super().write(s)

    monkeypatch.setattr("dyntree.models.load_model", lambda *a, **k: smol)
    out = Counting()
    monkeypatch.setattr(sys, "stdout", out)
    prompt = "Write a python function that returns the n-th fibonacci number."
    assert main(["generate", prompt, "--chat", "--drafter", "ngram", "--dtype", "fp32", "--max-new-tokens", "40",
                 "--compare"]) == 0
    err = capsys.readouterr().err
    from dyntree.common.config import SamplingParams, SpecConfig
    from dyntree.standalone.bench import encode_prompt
    from dyntree.standalone.engine import SpecEngine
    from dyntree.standalone.target import make_hf_drafter

    model, tok = smol
    want = SpecEngine(model, tok, make_hf_drafter("none", model, tok), SpecConfig(drafter="none")).generate(
        [encode_prompt(tok, prompt, True)], SamplingParams(max_new_tokens=40))[0]
    assert out.getvalue() == want.text + "\n"
    assert len(writes) > 5  # streamed step by step, not printed at the end
    summary = [line for line in err.splitlines() if line.startswith("[dyntree] 40 tokens in ")]
    assert summary and "tokens/s | tau " in summary[0] and "drafter ngram, tree own" in summary[0]
    assert "fp32 (as asked)" in summary[0]
    assert "speculation: " in err and "outputs identical: yes" in err
