"""Tree-building overhead per step: n-gram and Hydra drafters, dyntree trees filling 16 and 64
nodes, next to plain decoding in the same run (fp32, batch 1, one thread, Spec-Bench's first
prompt per category x 32 tokens; the setting of the CHANGELOG's stop-8 overhead numbers).

    OMP_NUM_THREADS=1 python benchmarks/builder_overhead.py  # -> benchmarks/results/builder_overhead/<machine>_fp32.json

``build_ms_per_step`` is drafting time outside the drafter's own calls (controller plan, tree
builder, candidate bookkeeping); ``build_pct_of_step`` its share of a whole step (drafting +
verify forward + accept). ``--before DIR`` adds the summaries of ``dyntree bench`` JSONs named
``{drafter}_{nodes}.json`` made by the same setting on an earlier commit (``--before-commit``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import torch

from dyntree.common.config import SamplingParams, SpecConfig
from dyntree.models import load_model, machine_kind, parse_dtype
from dyntree.standalone.bench import load_prompts, run_bench
from results_index import result_path  # benchmarks/ is on sys.path when run as a script

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
FIELDS = ("mode", "tau", "tokens_per_s", "speedup", "step_ms", "draft_ms_per_step", "build_ms_per_step",
          "build_pct_of_step", "draft_nodes_per_step", "identical_to_none")


def summary(doc: dict) -> list[dict]:
    return [{k: r.get(k) for k in FIELDS} for r in doc["runs"]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(result_path("builder_overhead", machine_kind(), "fp32")))
    ap.add_argument("--drafters", default="ngram,hydra")
    ap.add_argument("--budgets", default="16,64")
    ap.add_argument("--before", default=None, help="directory of earlier `dyntree bench` JSONs")
    ap.add_argument("--before-commit", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model("smollm2", parse_dtype("fp32"))
    prompts = load_prompts(SPEC_BENCH, per_category=1)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc: dict = {"setting": "fp32, batch 1, 1 thread, 1 prompt per Spec-Bench category x 32 new tokens, "
                            "tree dyntree, threshold 0 (fills the budget), max_depth 8", "commit": commit, "runs": {}}
    for drafter in args.drafters.split(","):
        for nodes in (int(b) for b in args.budgets.split(",")):
            spec = SpecConfig(drafter=drafter, max_nodes=nodes, max_depth=8, tree_options={"threshold": 0.0})
            res = run_bench(model, tok, prompts, ["none", "dyntree"], drafter, spec, SamplingParams(max_new_tokens=32),
                            1, False, "smollm2", "fp32")
            doc["runs"][f"{drafter}_{nodes}"] = summary(res)
            doc.setdefault("device", res["device"])
            doc.setdefault("versions", res["versions"])
            doc.setdefault("date", res["date"])
            print(drafter, nodes, json.dumps(doc["runs"][f"{drafter}_{nodes}"][-1]))
    if args.before:
        doc["before"] = {"commit": args.before_commit, "runs": {
            p.stem: summary(json.loads(p.read_text())) for p in sorted(Path(args.before).glob("*_*.json"))}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
