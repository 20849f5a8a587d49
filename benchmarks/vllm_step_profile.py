"""Where a decoding step's time goes inside vLLM, with and without dyntree.

    python benchmarks/vllm_step_profile.py [--configs none,dyntree,dyntree_ngram] [--batch 1] [--rounds 3] [--out ...]

Each config runs in its own process with vLLM's engine in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
on the ``chat`` (or ``--set code`` / ``both``) prompts of :mod:`vllm_bench` (``--batch`` prompts at a
time, 64 tokens, after an untimed warm-up), configs interleaved round by round (medians over the
rounds), with timers around the V1 runner's phases: the model forward (``_model_forward``; dyntree's
tree attention inside it is timed apart), the LM head (vLLM's logits processor), the rest of
``execute_model``, ``sample_tokens`` (sampling or tree verification, KV compaction) and the
proposer's drafting inside it; what remains of the wall time is vLLM's engine loop (scheduling,
output processing). Drafting is split further by timers on the speculator's pieces: the
controller's plan, the Hydra prefix layer, the Hydra heads, the n-gram lookup and the candidate
merge. Reports milliseconds per step and three shares of a step: outside vLLM's forward, outside
the forward and its LM head (the standalone ``step_profile``'s ``non_forward_pct``, whose target
is 10% at batch 1), and dyntree's own drafting and tree attention.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_bench import CONFIGS, CONTROLS, ENGINE_ARGS, ROOT, prompt_rows  # noqa: E402


#: Drafting's pieces: (module, owner in it or None for a module function, method, key); none runs
#: inside another, so what they leave of drafting is the rest (the builder, bookkeeping).
DRAFTING_PIECES = (
    ("dyntree.common.controller", "SpeculationController", "plan", "plan"),
    ("dyntree.common.drafters.hydra", "HydraDrafter", "_advance", "hydra_prefix_layer"),
    ("dyntree.common.hydra", "HydraHeads", "head_logits", "hydra_heads"),
    ("dyntree.common.drafters.ngram", "NgramDrafter", "expand", "ngram"),  # a level of a builder's tree
    ("dyntree.common.drafters.ngram", "NgramDrafter", "propose", "ngram"),  # its own trees
    ("dyntree.common.drafters.union", None, "merge_candidates", "merge"),
)


def _timed(owner: Any, name: str, key: str, totals: dict[str, float], calls: dict[str, int]) -> None:
    orig: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return orig(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - t
            calls[key] += 1

    setattr(owner, name, wrapper)


def _rows(prompt_set: str) -> list[dict[str, Any]]:
    """The prompt set's rows (``both``: chat then code, as vllm_bench's batch-16 cell)."""
    rows = prompt_rows()
    return rows["chat"] + rows["code"] if prompt_set == "both" else rows[prompt_set]


def worker(config: str, dtype: str, max_tokens: int, batch: int, prompt_set: str) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    import dyntree.vllm_plugin.attention as attention
    import dyntree.vllm_plugin.proposer as proposer
    from dyntree.models import model_path

    totals: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    _timed(GPUModelRunner, "execute_model", "execute_model", totals, calls)
    _timed(GPUModelRunner, "_model_forward", "forward", totals, calls)
    _timed(GPUModelRunner, "sample_tokens", "sample_tokens", totals, calls)
    _timed(attention, "tree_rows_attention", "tree_attention", totals, calls)
    _timed(proposer.DynTreeProposer, "propose", "propose", totals, calls)
    _timed(GPUModelRunner, "_prepare_inputs", "prepare_inputs", totals, calls)
    _timed(LogitsProcessor, "forward", "lm_head", totals, calls)
    for module, owner, name, key in DRAFTING_PIECES:
        mod = importlib.import_module(module)
        _timed(getattr(mod, owner) if owner else mod, name, "draft." + key, totals, calls)
    execute = GPUModelRunner.execute_model

    def counting(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        totals["query_rows"] += scheduler_output.total_num_scheduled_tokens
        return execute(self, scheduler_output, *args, **kwargs)

    GPUModelRunner.execute_model = counting
    path = str(model_path("smollm2"))
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["turns"][0]}], tokenize=False,
                                       add_generation_prompt=True) for r in _rows(prompt_set)]
    llm = LLM(model=path, dtype=dtype, max_model_len=2048, seed=0, enforce_eager=True, disable_log_stats=False,
              speculative_config={**CONFIGS, **CONTROLS}[config], **ENGINE_ARGS.get(config, {}))
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    totals.clear()
    calls.clear()
    tokens, started = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        out = llm.generate(prompts[i : i + batch], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in out)
    wall = time.perf_counter() - started
    n = calls["execute_model"]
    ms = {k: 1e3 * v / n for k, v in totals.items()}
    step_ms = 1e3 * wall / n
    tree = ms.get("tree_attention", 0.0)
    phases = {
        "vllm_forward": ms["forward"] - tree,
        "tree_attention": tree,
        "lm_head": ms["lm_head"],
        "prepare_inputs": ms["prepare_inputs"],  # vLLM's own and (dyntree) the step record and tree plan
        "execute_model_rest": ms["execute_model"] - ms["forward"] - ms["prepare_inputs"] - ms["lm_head"],
        "drafting": ms.get("propose", 0.0),
        "sampling_and_verify": ms["sample_tokens"] - ms.get("propose", 0.0),
        "engine_loop": step_ms - ms["execute_model"] - ms["sample_tokens"],
    }
    pieces = {key: ms.get("draft." + key, 0.0) for *_, key in DRAFTING_PIECES}  # ngram's two timers: one key
    pieces["rest"] = phases["drafting"] - sum(pieces.values())
    return {"steps": n, "tokens": tokens, "tokens_per_s": tokens / wall, "step_ms": step_ms,
            "query_rows_per_step": round(totals["query_rows"] / n, 2),
            "phases_ms": {k: round(v, 3) for k, v in phases.items()},
            "drafting_ms": {k: round(v, 3) for k, v in pieces.items()} if phases["drafting"] else {},
            **_shares(phases, step_ms)}


def _shares(phases: dict[str, float], step_ms: float) -> dict[str, float]:
    """A step's shares: outside vLLM's forward, outside the forward and its LM head, dyntree's
    drafting and tree attention."""
    return {"share_outside_vllm_forward": round(1 - phases["vllm_forward"] / step_ms, 4),
            "share_outside_forward_and_lm_head": round(1 - (phases["vllm_forward"] + phases["lm_head"]) / step_ms, 4),
            "share_drafting_and_tree_attention": round((phases["drafting"] + phases["tree_attention"]) / step_ms, 4)}


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A config's rounds as one: the median of every number (per phase and piece), the rounds kept."""
    def med(key: str, sub: str | None = None) -> float:
        return round(statistics.median((r[key] if sub is None else r[key].get(sub, 0.0)) for r in runs), 3)

    phases = {k: med("phases_ms", k) for k in runs[0]["phases_ms"]}
    pieces = {k: med("drafting_ms", k) for k in dict.fromkeys(k for r in runs for k in r["drafting_ms"])}
    step_ms = med("step_ms")
    return {"rounds": len(runs), "tokens_per_s": med("tokens_per_s"), "step_ms": step_ms,
            "query_rows_per_step": med("query_rows_per_step"), "phases_ms": phases, "drafting_ms": pieces,
            **_shares(phases, step_ms), "per_round": runs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="none,dyntree,dyntree_ngram")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    ap.add_argument("--set", default="chat", choices=("chat", "code", "both"),
                    help="prompt set (vllm_bench's; both: chat then code)")
    ap.add_argument("--rounds", type=int, default=3, help="configs interleaved round by round; medians")
    ap.add_argument("--out")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    import torch

    from dyntree.models import machine_kind, pick_dtype

    if args.dtype == "auto":
        args.dtype = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[pick_dtype("auto", torch.device("cpu"))[0]]
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.dtype, args.max_tokens, args.batch, args.set)), flush=True)
        return 0
    short = {"bfloat16": "bf16", "float32": "fp32"}[args.dtype]
    tag = ("" if args.batch == 1 else f"_b{args.batch}") + ("" if args.set == "chat" else f"_{args.set}")
    out = Path(args.out or ROOT / "benchmarks" / "results" / "vllm_step_profile" / f"{machine_kind()}_{short}{tag}.json")
    configs = args.configs.split(",")
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for k in range(args.rounds):
        for c in configs:
            proc = subprocess.run([sys.executable, __file__, "--worker", c, "--dtype", args.dtype,
                                   "--max-tokens", str(args.max_tokens), "--batch", str(args.batch), "--set", args.set],
                                  capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                print(proc.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"config {c} failed")
            r = json.loads(line.removeprefix("RESULT "))
            runs[c].append(r)
            print(f"round {k + 1}/{args.rounds} {c:14s} {r['tokens_per_s']:.1f} tok/s, {r['step_ms']:.1f} ms/step, "
                  f"{r['query_rows_per_step']} rows/step: " + ", ".join(f"{p} {v:.1f}" for p, v in r["phases_ms"].items()),
                  flush=True)
    results = {c: _median(rs) for c, rs in runs.items()}
    for c, r in results.items():
        print(f"median {c:14s} {r['tokens_per_s']:.1f} tok/s, {r['step_ms']:.1f} ms/step: "
              + ", ".join(f"{p} {v:.2f}" for p, v in {**r["phases_ms"], **r["drafting_ms"]}.items()), flush=True)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    import vllm

    doc = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_kind(), "cpu": cpu,
           "dtype": short, "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
           "setting": f"batch {args.batch}, {len(_rows(args.set))} {args.set} prompts x {args.max_tokens} tokens, "
                      f"in-process engine, {args.rounds} rounds (medians)",
           "configs": results,
           "summary": {c: f"{r['share_outside_vllm_forward']:.0%} of a step outside vLLM's forward, "
                          f"{r['share_outside_forward_and_lm_head']:.0%} outside it and its LM head, "
                          f"{r['share_drafting_and_tree_attention']:.0%} drafting and tree attention "
                          f"({r['step_ms']:.1f} ms/step, {r['tokens_per_s']:.1f} tok/s)" for c, r in results.items()}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
