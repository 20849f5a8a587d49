"""Where one decoding step's time goes in the standalone engine, per phase, at batch 1 and 8.

    python benchmarks/step_profile.py [--out PATH] [--dtype auto]
        [--drafters none ngram hydra] [--batch-sizes 1,8] [--new 32] [--no-adaptive]
        [--max-nodes 16] [--max-depth 8]

Each phase of ``SpecEngine._step`` is timed by wrapping the method that does it (the engine is not
changed): ``propose`` (controller plan, drafting, tree building), ``mask`` (the 4-D tree mask and
positions), ``forward`` (the target decoder over the trees), ``logits`` (LM head over the tree
nodes; the rest of the forward block), ``accept`` (verification and what the speculator learns),
``compact`` (KV moves), ``hidden`` (hidden states pushed to the drafter), ``commit`` (tokens, EOS
and stop checks) and ``other`` (the rest of the step). Prefill is not counted. The prompts are the
first Spec-Bench prompt of each category (chat template), at most 384 prompt tokens so a batch
pads little. ``non_forward_pct`` is everything but ``forward`` and ``logits`` as a share of the
step: the number the per-step overhead target (< 10% at batch 1) is about.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from dyntree.common.config import SamplingParams, SpecConfig
from dyntree.models import dtype_name, load_model, machine_kind, pick_dtype
from dyntree.standalone.bench import _device, _versions, encode_prompt, load_prompts
from dyntree.standalone.engine import SpecEngine
from dyntree.standalone.target import make_hf_drafter
from results_index import result_path  # benchmarks/ is on sys.path when run as a script

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
PHASES = ("propose", "mask", "forward", "logits", "accept", "compact", "hidden", "commit", "other")


def profile(engine: SpecEngine, prompts: list[list[int]], batch: int, params: SamplingParams) -> dict:
    """Run ``prompts``, at most ``batch`` at once (continuous batching); return ms per step of every
    phase."""
    spent: dict[str, float] = defaultdict(float)
    in_step = [False]

    def timed(obj, name: str, phase: str) -> None:
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def wrapper(*a, **k):
            if not in_step[0]:
                return fn(*a, **k)
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[phase] += time.perf_counter() - t

        setattr(obj, name, wrapper)

    step = engine._step
    steps = [0]

    def step_wrapper(*a, **k):
        in_step[0], t = True, time.perf_counter()
        try:
            return step(*a, **k)
        finally:
            spent["step"] += time.perf_counter() - t
            in_step[0] = False
            steps[0] += 1

    sp = engine.speculator
    for obj, name, phase in [(sp, "propose", "propose"), (engine, "_tree_mask", "mask"), (engine, "_forward", "forward"),
                             (sp, "accept", "accept"), (engine, "_compact", "compact"),
                             (sp, "observe_hidden", "hidden"), (engine, "_commit", "commit")]:
        timed(obj, name, phase)
    engine._step = step_wrapper
    engine.generate(prompts[:batch], params.model_copy(update={"max_new_tokens": 8}))  # warm-up
    spent.clear()
    steps[0] = 0
    sp.stats.reset()
    start = time.perf_counter()
    outs = engine.generate(prompts, params, max_batch_size=batch)
    wall = time.perf_counter() - start
    tokens, verified = sum(len(o.token_ids) for o in outs), max(sum(o.steps for o in outs), 1)
    # the LM head and the logits' dtype cast run inside _step's forward block, outside _forward
    spent["logits"] = max(sp.stats.forward_s - spent["forward"] - spent["mask"], 0.0)
    spent["other"] = spent["step"] - sum(spent[p] for p in PHASES if p != "other")
    n = max(steps[0], 1)
    ms = {p: round(spent[p] / n * 1e3, 3) for p in PHASES}
    step_ms = spent["step"] / n * 1e3
    return {"steps": steps[0], "step_ms": round(step_ms, 3), "ms_per_step": ms,
            "pct_of_step": {p: round(100 * ms[p] / step_ms, 2) for p in PHASES},
            "non_forward_pct": round(100 * (1 - (ms["forward"] + ms["logits"]) / step_ms), 2),
            "tau": round(sum(o.step_tokens for o in outs) / verified, 3), "tokens_per_s": round(tokens / wall, 3),
            "draft_nodes_per_request_step": round(sum(o.draft_nodes for o in outs) / verified, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="default benchmarks/results/step_profile/<machine>_<dtype>.json")
    ap.add_argument("--drafters", nargs="+", default=["none", "ngram", "hydra"],
                    help="drafter specs, space-separated (a spec may hold commas: qspec:w8a16,perchannel)")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-nodes", type=int, default=16)
    ap.add_argument("--max-depth", type=int, default=8)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype, why = pick_dtype(args.dtype, torch.device("cpu"))
    model, tok = load_model("smollm2", dtype)
    encoded = [encode_prompt(tok, p.text, True) for p in load_prompts(SPEC_BENCH, per_category=1)]
    encoded = [e for e in encoded if len(e) <= 384]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    prompts = (encoded * (1 + max(batches) // len(encoded)))[: max(len(encoded), max(batches))]
    params = SamplingParams(max_new_tokens=args.new)
    doc = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "device": _device(), "versions": _versions(),
           "dtype": str(dtype).removeprefix("torch."), "dtype_why": why, "adaptive": args.adaptive,
           "setting": f"{len(prompts)} prompts (first Spec-Bench prompt per category, <= 384 tokens, chat) x "
                      f"{args.new} new tokens, greedy, node budget {args.max_nodes}, depth {args.max_depth}", "runs": []}
    for drafter in args.drafters:
        for batch in batches:
            spec = SpecConfig(drafter=drafter, adaptive=args.adaptive and drafter != "none",
                              max_nodes=args.max_nodes, max_depth=args.max_depth)
            engine = SpecEngine(model, tok, make_hf_drafter(drafter, model, tok), spec)
            engine.prepare()
            run = {"drafter": drafter, "batch_size": batch, **profile(engine, prompts, batch, params)}
            doc["runs"].append(run)
            print(f"{drafter:<6} batch {batch:<3} step {run['step_ms']:8.1f} ms  non-forward {run['non_forward_pct']:5.1f}%  "
                  + "  ".join(f"{p} {run['ms_per_step'][p]:.1f}" for p in PHASES), flush=True)
    out = Path(args.out) if args.out else result_path("step_profile", machine_kind(), dtype_name(dtype))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
