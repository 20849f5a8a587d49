"""dyntree inside vLLM on a CUDA machine: identity with plain decoding and speed, in one run.

    python benchmarks/vllm_gpu.py [--model DIR | --gguf FILE] [--rounds 1] [--dtype float32] [--out JSON]

For a machine with vLLM 0.26 (``../shared/vllm-gpu``'s bundle on ``PYTHONPATH``; ``docs/vllm.md``
says how its parts and the model travel). Two phases, each config in this process one after the
other (no speculation and vLLM's ``ngram`` first, before dyntree's backend is registered), every
engine ``enforce_eager=True`` on ``TRITON_ATTN``:

1. ``tiny``: a random 4-layer Llama (built here, no tokenizer) on repetitive token-id prompts,
   batch 4: no speculation, vLLM ``ngram`` and dyntree ``ngram`` must give float32 greedy outputs
   identical to no speculation;
2. ``smollm2`` (when ``--model``/``--gguf`` or the cached SmolLM2 directory is there): no
   speculation, vLLM ``ngram``, dyntree default (``hydra+ngram``), ``ngram`` and ``hydra`` on 8
   Spec-Bench chat prompts x ``--max-tokens``, at batch 1 (one by one) and batch 8; tokens/s,
   tau, speedups against no speculation and vLLM ``ngram``, identity with no speculation.

A config that fails is recorded with its error and the run goes on. Writes JSON (device, versions,
date, every cell) under ``benchmarks/results/vllm_gpu/``; exits 0 only if every config ran and
every float32 output matched no speculation's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # the slim bundle has no FlashInfer
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: engines one after another

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_bench import SPEC_BENCH, _counters, summarize  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
TINY_CONFIGS: dict[str, dict[str, Any] | None] = {
    "none": None, "vllm_ngram": NGRAM, "dyntree_ngram": {"method": "dyntree", "drafter": "ngram"},
}
CONFIGS: dict[str, dict[str, Any] | None] = {
    "none": None, "vllm_ngram": NGRAM, "dyntree": {"method": "dyntree"},
    "dyntree_ngram": {"method": "dyntree", "drafter": "ngram"}, "dyntree_hydra": {"method": "dyntree", "drafter": "hydra"},
}
T0 = time.time()


def log(*parts: Any) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *parts, flush=True)


def tiny_llama(path: Path) -> Path:
    """A random 4-layer Llama checkpoint (float32 weights, seeded), built once."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048, rope_theta=10000.0,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    cfg.architectures = ["LlamaForCausalLM"]
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def tiny_prompts(n: int = 4) -> list[list[int]]:
    """Token-id prompts: random ones, and repeated patterns the n-gram drafters can match."""
    import random

    rng = random.Random(1234)
    out = []
    for i in range(n):
        pattern = [rng.randrange(3, 32000) for _ in range(12 if i % 2 else 48)]
        out.append(pattern * (4 if i % 2 else 1))
    return out


def engine(model: str, dtype: str, spec: dict[str, Any] | None, tokenizer: bool) -> Any:
    from vllm import LLM

    cuda = not os.environ.get("DYNTREE_GPU_CHECK_ON_CPU")
    extra: dict[str, Any] = {"attention_config": {"backend": "TRITON_ATTN"}, "gpu_memory_utilization": 0.3} if cuda else {}
    return LLM(model=model, dtype=dtype, enforce_eager=True, seed=0, max_model_len=2048,
               skip_tokenizer_init=not tokenizer, disable_log_stats=False, speculative_config=spec, **extra)


def free(llm: Any) -> None:
    """Shut an in-process engine down and give its GPU memory back before the next one."""
    import torch

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa: BLE001 - the next engine may still fit
        log("shutdown:", type(e).__name__, e)
    del llm
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception as e:  # noqa: BLE001
        log("cleanup:", type(e).__name__, e)
    torch.cuda.empty_cache()


def run_cells(llm: Any, sets: dict[str, list[Any]], batches: list[int], max_tokens: int) -> dict[str, dict[str, Any]]:
    """Each prompt set at each batch size: tokens/s, tau, drafting steps and the outputs."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    cells = {}
    for name, prompts in sets.items():
        for b in batches:
            before, outs, wall = _counters(llm), [], 0.0
            for i in range(0, len(prompts), b):
                t = time.perf_counter()
                res = llm.generate(prompts[i : i + b], params, use_tqdm=False)
                wall += time.perf_counter() - t
                outs += [list(o.outputs[0].token_ids) for o in res]
            after = _counters(llm)
            drafts = after.get("vllm:spec_decode_num_drafts", 0) - before.get("vllm:spec_decode_num_drafts", 0)
            acc = after.get("vllm:spec_decode_num_accepted_tokens", 0) - before.get("vllm:spec_decode_num_accepted_tokens", 0)
            tokens = sum(len(o) for o in outs)
            cells[f"{name}/b{b}"] = {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                                     "tau": 1 + acc / drafts if drafts else 1.0, "drafting_steps": int(drafts),
                                     "outputs": outs}
            log(f"  {name}/b{b}: {tokens / wall:.1f} tok/s, tau {cells[f'{name}/b{b}']['tau']:.2f}")
    return cells


def phase(model: str, configs: dict[str, dict[str, Any] | None], sets: dict[str, list[Any]], batches: list[int],
          rounds: int, dtype: str, max_tokens: int, tokenizer: bool) -> dict[str, Any]:
    """Every config, ``rounds`` times, in order; a failing config is recorded and skipped after."""
    results: list[dict[str, dict[str, Any]]] = []
    errors: dict[str, str] = {}
    order = list(configs)
    if os.environ.get("DYNTREE_GPU_CHECK_ON_CPU") and "vllm_ngram" in order:
        # vLLM's CPU platform cannot start another engine in a process that loaded numba (its
        # n-gram proposer's): its kernel rebinding trips over llvmlite's module objects
        order.append(order.pop(order.index("vllm_ngram")))
    for r in range(rounds):
        results.append({})
        for name in order:
            spec = configs[name]
            if name in errors:
                continue
            log(f"round {r + 1}/{rounds} {name}: {spec}")
            llm = None
            try:
                llm = engine(model, dtype, spec, tokenizer)
                warm = {k: v[:2] for k, v in sets.items()}
                run_cells(llm, warm, [2], 8)  # Triton's JIT and the controller's cost model, untimed
                results[-1][name] = run_cells(llm, sets, batches, max_tokens)
            except Exception:  # noqa: BLE001 - record it, run the other configs
                errors[name] = traceback.format_exc()[-3000:]
                log(f"{name} FAILED:\n{errors[name]}")
            finally:
                if llm is not None:
                    free(llm)
    ok = [c for c in configs if c not in errors]
    rounds_ok = [{c: rr[c] for c in ok} for rr in results]
    summary = summarize(rounds_ok, ok) if ok and all(rounds_ok) else {}
    return {"configs": summary, "errors": errors}


def identical(result: dict[str, Any]) -> bool:
    """Whether every config ran and every output matched no speculation's."""
    cfgs = result["configs"]
    return not result["errors"] and bool(cfgs) and all(
        cell.get("identical_to_none", 1.0) == 1.0 for c in cfgs.values() for cell in c.values())


def chat_prompts(model: str, n: int, questions: Path) -> list[str]:
    """The first ``n`` non-coding MT-Bench questions of Spec-Bench, in the model's chat template."""
    from transformers import AutoTokenizer

    rows = [json.loads(line) for line in questions.open()][:80]
    chat = [r for r in rows if r["category"] != "coding"][:: 70 // n][:n]
    tok = AutoTokenizer.from_pretrained(model)
    return [tok.apply_chat_template([{"role": "user", "content": r["turns"][0]}], tokenize=False,
                                    add_generation_prompt=True) for r in chat]


def smollm2_dir(args: argparse.Namespace) -> str | None:
    if args.model:
        return args.model
    from dyntree.models import _convert_gguf, cache_root

    if args.gguf:
        out = cache_root() / "models" / "SmolLM2-135M-Instruct-gpu"
        if not (out / "config.json").exists():
            log(f"converting {args.gguf} -> {out}")
            _convert_gguf(Path(args.gguf), out)
        return str(out)
    cached = sorted((cache_root() / "models").glob("SmolLM2-135M-Instruct-*"))
    return str(cached[0]) if cached else None


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    import torch
    import vllm

    try:  # not imported: vLLM's CPU platform rebinds kernels by scanning every loaded module
        triton = version("triton")
    except PackageNotFoundError:
        triton = "none"
    return {"vllm": vllm.__version__, "torch": torch.__version__, "triton": triton,
            "cuda": str(torch.version.cuda), "python": platform.python_version(), "dyntree": _dyntree_version()}


def _dyntree_version() -> str:
    import subprocess

    from dyntree import __version__

    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return f"{__version__} ({rev or 'no git'})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="SmolLM2-135M-Instruct as a Hugging Face directory")
    ap.add_argument("--gguf", help="or its GGUF (converted once; needs the gguf and accelerate packages)")
    ap.add_argument("--questions", default=str(SPEC_BENCH), help="Spec-Bench question.jsonl")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--skip", default="", help="phases to leave out: tiny, smollm2 (comma separated)")
    ap.add_argument("--out", help="default: benchmarks/results/vllm_gpu/<device>_<dtype>.json")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="run the same flow on vLLM's CPU backend (checks this script, not the GPU path)")
    args = ap.parse_args()
    import torch

    if args.cpu_dry_run:
        os.environ["DYNTREE_GPU_CHECK_ON_CPU"] = "1"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    elif not torch.cuda.is_available():
        print("vllm_gpu.py needs a CUDA device (torch.cuda.is_available() is False; --cpu-dry-run checks the "
              "script on vLLM's CPU backend)", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0) if not args.cpu_dry_run else "cpu-dry-run"
    short = {"float32": "fp32", "bfloat16": "bf16"}[args.dtype]
    out = Path(args.out or ROOT / "benchmarks" / "results" / "vllm_gpu"
               / f"{device.lower().replace(' ', '_')}_{short}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    capability = list(torch.cuda.get_device_capability(0)) if not args.cpu_dry_run else None
    doc: dict[str, Any] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": device,
                           "capability": capability, "versions": versions(),
                           "dtype": short, "enforce_eager": True,
                           "attention_backend": "CPU_ATTN" if args.cpu_dry_run else "TRITON_ATTN",
                           "max_tokens": args.max_tokens, "rounds": args.rounds, "phases": {}}
    log("device", device, doc["versions"])
    skip = set(filter(None, args.skip.split(",")))
    steps: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    if "tiny" not in skip:
        tiny = str(tiny_llama(Path(os.environ.get("TMPDIR", "/tmp")) / "dyntree-tiny-llama"))
        steps.append(("tiny", lambda: phase(tiny, TINY_CONFIGS, {"ids": [{"prompt_token_ids": p} for p in tiny_prompts()]},
                                            [4], 1, args.dtype, 32, tokenizer=False)))
    smol = smollm2_dir(args) if "smollm2" not in skip else None
    if smol is not None:
        chat = chat_prompts(smol, 8, Path(args.questions))
        steps.append(("smollm2", lambda: phase(smol, CONFIGS, {"chat": chat}, [1, 8], args.rounds, args.dtype,
                                               args.max_tokens, tokenizer=True)))
    elif "smollm2" not in skip:
        log("no SmolLM2 directory (--model / --gguf): the smollm2 phase is left out")
        doc["phases"]["smollm2"] = {"skipped": "no model"}
    for name, fn in steps:
        log(f"== {name}")
        doc["phases"][name] = res = fn()
        res["identical_fp32"] = identical(res) if args.dtype == "float32" else None
        out.write_text(json.dumps(doc, indent=1) + "\n")  # after every phase: a later crash keeps it
    ok = all(p.get("identical_fp32") is not False and not p.get("errors") for p in doc["phases"].values()
             if "skipped" not in p)
    doc["verdict"] = "PASS" if ok else "FAIL"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    log(f"{doc['verdict']}: wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
