"""vLLM with and without speculation, side by side in one run: no speculation, vLLM's own ``ngram``,
and ``dyntree`` with each drafter (SmolLM2, Spec-Bench prompts across categories, chat template).

    python benchmarks/vllm_bench.py --out benchmarks/results/vllm_bench_cpu.json [--dtype auto]

Per config and batch size: tokens/s (generated tokens over the wall time of ``LLM.generate`` for
each batch, prompts in order), tau (1 + accepted draft tokens per drafting step, from vLLM's
spec-decode counters: over the steps that drafted), how many request-steps drafted, and whether
the outputs equal the run without speculation. Plain decoding runs first and again last
(``none_again``); speedups are against the faster of the two, so drift over the run cannot flatter
speculation. ``dyntree_*`` configs run the defaults (adaptive
controller on); ``*_fixed`` pin every step to the full tree. Each config runs in this process one
after another; vLLM's start-up and one warm-up pass (all prompts, 16 tokens, largest batch: the
controller's cost model is timed there) are not timed. ``--dtype auto``: bf16 on a CPU with native
bf16, else fp32 (as ``dyntree generate`` picks).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
CONFIGS = {
    "none": None,
    "vllm_ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1},
    "dyntree_ngram": {"method": "dyntree", "drafter": "ngram", "num_speculative_tokens": 16, "max_depth": 6},
    "dyntree_hydra": {"method": "dyntree", "drafter": "hydra", "num_speculative_tokens": 16, "max_depth": 4},
    "dyntree_qspec": {"method": "dyntree", "drafter": "qspec", "num_speculative_tokens": 16, "max_depth": 6},
    "dyntree_ngram_fixed": {"method": "dyntree", "drafter": "ngram", "num_speculative_tokens": 16, "max_depth": 6,
                            "adaptive": False},
    "dyntree_hydra_fixed": {"method": "dyntree", "drafter": "hydra", "num_speculative_tokens": 16, "max_depth": 4,
                            "adaptive": False},
}


def _counters(llm) -> dict[str, float]:
    return {m.name: float(m.value) for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode_num") and isinstance(getattr(m, "value", None), (int, float))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto", help="auto | bfloat16 | float32")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import torch
    import vllm
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from dyntree.models import model_path, pick_dtype

    if args.dtype == "auto":
        args.dtype = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[pick_dtype("auto", torch.device("cpu"))[0]]
    path = str(model_path("smollm2"))
    tok = AutoTokenizer.from_pretrained(path)
    rows = [json.loads(line) for line in SPEC_BENCH.open()]
    picked = rows[:: max(1, len(rows) // args.prompts)][: args.prompts]
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["turns"][0]}], tokenize=False,
                                       add_generation_prompt=True) for r in picked]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    doc = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "device": f"cpu ({platform.machine()}, {os.cpu_count()} cores)", "dtype": args.dtype,
           "versions": {"vllm": vllm.__version__, "torch": torch.__version__}, "model": "SmolLM2-135M-Instruct",
           "prompts": [r.get("question_id", i) for i, r in enumerate(picked)], "max_tokens": args.max_tokens,
           "configs": {}}
    order = args.configs.split(",")
    if "none" in order:
        order.append("none_again")  # plain decoding once more at the end: the baseline is the faster run
    for name in order:
        llm = LLM(model=path, dtype=args.dtype, max_model_len=2048, seed=0, enforce_eager=True,
                  disable_log_stats=False, speculative_config=CONFIGS[name.removesuffix("_again")])
        llm.generate(prompts[: max(sizes)], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)  # warm-up
        runs = {}
        for b in sizes:
            before = _counters(llm)
            tokens, outs, wall = 0, [], 0.0
            for i in range(0, len(prompts), b):
                t = time.perf_counter()
                res = llm.generate(prompts[i : i + b], params, use_tqdm=False)
                wall += time.perf_counter() - t
                outs += [list(o.outputs[0].token_ids) for o in res]
                tokens += sum(len(o.outputs[0].token_ids) for o in res)
            after = _counters(llm)
            drafts = after.get("vllm:spec_decode_num_drafts", 0) - before.get("vllm:spec_decode_num_drafts", 0)
            acc = after.get("vllm:spec_decode_num_accepted_tokens", 0) - before.get("vllm:spec_decode_num_accepted_tokens", 0)
            runs[str(b)] = {"tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 3),
                            "tau": round(1 + acc / drafts, 4) if drafts else 1.0, "drafting_steps": drafts, "outputs": outs}
            print(f"{name:14} batch {b}: {tokens / wall:7.2f} tok/s  tau {runs[str(b)]['tau']:.2f}", flush=True)
        doc["configs"][name] = runs
        del llm
        gc.collect()
    base = doc["configs"].get("none")
    if base is not None:
        again = doc["configs"]["none_again"]
        base = {b: max(base[b], again[b], key=lambda r: r["tokens_per_s"]) for b in base}
    for name, runs in doc["configs"].items():
        for b, run in runs.items():
            if base is not None:
                run["speedup"] = round(run["tokens_per_s"] / base[b]["tokens_per_s"], 4)
                run["identical_to_none"] = sum(x == y for x, y in zip(run["outputs"], base[b]["outputs"])) / len(run["outputs"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
