"""Batch-size sweep on this CPU: the adaptive controller vs plain decoding vs fixed settings.

At each batch size (1, 2, 4, 8, 16, 32) the same Spec-Bench prompts are decoded (greedy, fp32 by
default: on this CPU batched bf16 runs ~4x slower than fp32; n-gram drafter by default) by: plain decoding; fixed settings (a 4-token chain, a 16-node dyntree); and the
controller (``adaptive``, dyntree up to 16 nodes), whose cost model is timed once at start-up and
shared. ``max(batch, --min-prompts)`` prompts are decoded per batch
size, so small batch sizes run several batches. Prompts longer than ``--max-prompt-tokens`` are
skipped: a batch is padded to its longest prompt, and a few 2k-token prompts would turn the sweep
into a prefill benchmark. Throughput is reported both over the whole run (``tokens_per_s``,
prefill included) and over the decode steps alone (``decode_tokens_per_s``), which the plot shows. Writes
``benchmarks/results/batch_sweep/<machine>_<dtype>.json`` and the plot beside it (tokens/s vs batch size).

    python benchmarks/batch_sweep.py --new 16 --min-prompts 2 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import datetime, timezone
from pathlib import Path

import torch

from dyntree.common.config import SamplingParams, SpecConfig
from dyntree.common.drafters import make_drafter
from dyntree.models import load_model, machine_kind, parse_dtype
from dyntree.standalone.bench import _device, _versions, compare, encode_prompt, load_prompts, run_mode
from dyntree.standalone.engine import SpecEngine
from results_index import result_path  # benchmarks/ is on sys.path when run as a script

SPEC_BENCH = Path(os.environ.get("DYNTREE_SHARED", Path(__file__).resolve().parents[2] / "shared")) / "data/spec_bench/question.jsonl"

#: (label, mode, SpecConfig) of each setting compared with plain decoding.
SETTINGS = (
    ("chain-4", "chain", SpecConfig(max_nodes=4, max_depth=4)),
    ("dyntree-16", "dyntree", SpecConfig(max_nodes=16, max_depth=8)),
    ("adaptive", "dyntree", SpecConfig(max_nodes=16, max_depth=8, adaptive=True)),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--min-prompts", type=int, default=4)
    ap.add_argument("--max-prompt-tokens", type=int, default=384, help="skip longer prompts (chat-encoded)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="fp32", help="fp32, bf16 or fp16")
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--settings", default=",".join(s[0] for s in SETTINGS),
                    help="comma-separated subset of the settings compared with plain decoding")
    ap.add_argument("--out", default=None, help="default benchmarks/results/batch_sweep/<machine>_<dtype>.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    model, tok = load_model("smollm2", parse_dtype(args.dtype))
    every = [p for p in load_prompts(SPEC_BENCH) if len(encode_prompt(tok, p.text, chat=True)) <= args.max_prompt_tokens]
    batches = [int(b) for b in args.batches.split(",")]
    n_max = max(max(batches), args.min_prompts)
    pool = every[:: max(1, len(every) // n_max)][:n_max]
    cost = SpecEngine(model, tok, make_drafter("none"), SpecConfig(drafter="none")).measure_cost()
    params = SamplingParams(max_new_tokens=args.new)
    rows = []
    for b in batches:
        prompts = pool[: max(b, args.min_prompts)]
        encoded = [encode_prompt(tok, p.text, chat=True) for p in prompts]
        ids = [p.id for p in prompts]
        base = run_mode(model, tok, encoded, ids, "none", SpecConfig(drafter="none"), params, b)
        compare(base, base)
        base["setting"] = "plain"
        runs = [base]
        for label, mode, spec in (s for s in SETTINGS if s[0] in args.settings.split(",")):
            run = run_mode(model, tok, encoded, ids, mode, spec.model_copy(update={"drafter": args.drafter}),
                           params, b, cost)
            compare(base, run)
            run["setting"] = label
            runs.append(run)
        for r in runs:
            r.pop("outputs")
            r["batch_size"] = b
            r["decode_tokens_per_s"] = round(r["tokens"] / (r["draft_s"] + r["verify_s"]), 3)
            r["decode_speedup"] = round(r["decode_tokens_per_s"] * (base["draft_s"] + base["verify_s"]) / base["tokens"], 4)
            print(f"B={b:<3} {r['setting']:11} tau={r['tau']:.2f} tok/s={r['tokens_per_s']:.2f} "
                  f"speedup={r['speedup']:.2f} decode tok/s={r['decode_tokens_per_s']:.2f} "
                  f"decode speedup={r['decode_speedup']:.2f} nodes/step={r['draft_nodes_per_step']:.1f}", flush=True)
        rows += runs
    doc = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": _device(), "versions": _versions(), "dtype": args.dtype, "drafter": args.drafter,
        "threads": args.threads,
        "load_avg_start": [round(x, 2) for x in load_start], "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        "note": "2-core CPU, possibly shared with other jobs (see load_avg); wall-clock numbers are noisy",
        "max_new_tokens": args.new, "max_prompt_tokens": args.max_prompt_tokens, "cost_model_ms": dict(zip(cost.xs, [round(y, 3) for y in cost.ys])),
        "runs": rows,
    }  # fmt: skip
    out = Path(args.out) if args.out else result_path("batch_sweep", machine_kind(), args.dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    plot(doc, out.with_suffix(".png"))
    print(f"wrote {out}")


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for setting in ("plain", *(s[0] for s in SETTINGS if any(r["setting"] == s[0] for r in doc["runs"]))):
        sel = sorted((r for r in doc["runs"] if r["setting"] == setting), key=lambda r: r["batch_size"])
        bs = [r["batch_size"] for r in sel]
        axes[0].plot(bs, [r["decode_tokens_per_s"] for r in sel], marker="o", label=setting)
        axes[1].plot(bs, [r["decode_speedup"] for r in sel], marker="o", label=setting)
    for ax, title in zip(axes, ("decode tokens/s (all requests)", "decode speedup over plain")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_title(title)
    axes[1].axhline(1.0, color="k", lw=0.8)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M {doc['dtype']}, {doc['drafter']} drafter, {doc['max_new_tokens']} tokens/prompt, "
                 f"{doc['threads']} thread(s), load avg {doc['load_avg_start'][0]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
