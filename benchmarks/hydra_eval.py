"""Evaluate Hydra heads on SmolLM2: per-head agreement with the target and speculative decoding.

1. Plain greedy decoding (the ``none`` drafter) of Spec-Bench prompts gives the reference outputs.
2. Per-head top-1/top-5 agreement on the MT-Bench prompts: one target forward over prompt + output
   gives the hidden states; head ``k`` at output position ``t`` is teacher-forced with the target's
   own tokens and scored against the target's token ``x_{t+k+1}``.
3. tau (tokens per verify step) and tokens/s for each drafter (Hydra heads, the independent
   Medusa-style ablation, Hydra++ heads with prefix attention when given, n-gram) at the same node budget, greedy, in fp32, with the fraction of
   outputs identical to plain decoding.
4. The reduced-vocabulary trade-off: how many of the target's tokens the reduced vocabulary covers
   (an upper bound on acceptance), and the head forward cost with reduced vs full output.

Writes one JSON document (``--out``). Run: ``python benchmarks/hydra_eval.py --help``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from heads_compare import score  # benchmarks/ is on sys.path when run as a script
from results_index import result_path

from dyntree.common.config import SamplingParams, SpecConfig
from dyntree.common.drafters.hydra import SHIPPED_HEADS
from dyntree.common.hydra import HydraHeads, TargetIdentity
from dyntree.common.hydra_checkpoint import load_heads
from dyntree.models import load_model, machine_kind
from dyntree.standalone.bench import Prompt, encode_prompt, load_prompts
from dyntree.standalone.engine import SpecEngine
from dyntree.standalone.target import hf_target, make_hf_drafter

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def _pick(path: Path, per_category: int, mt_bench_extra: int) -> tuple[list, list]:
    """``per_category`` prompts of each category (spread out) for tau; more MT-Bench for agreement."""
    rows = [Prompt(p.id, p.text, "mt_bench" if p.category in MT_BENCH else p.category) for p in load_prompts(path)]
    by_cat: dict[str, list] = {}
    for p in rows:
        by_cat.setdefault(p.category, []).append(p)
    tau_set, agree_set = [], []
    for cat in CATEGORIES:
        items = by_cat[cat]
        n = per_category + (mt_bench_extra if cat == "mt_bench" else 0)
        chosen = items[:: max(1, len(items) // n)][:n]
        tau_set += chosen[:per_category]
        if cat == "mt_bench":
            agree_set = chosen
    return tau_set, agree_set


def _run(model, tok, spec: str, prompts: list, budget: int, depth: int, new: int) -> tuple[list, list, dict]:
    """Decode ``prompts`` one at a time (batch 1: tokens/s is per-request latency)."""
    drafter = make_hf_drafter(spec, model, tok)
    engine = SpecEngine(model, tok, drafter, SpecConfig(drafter=spec, max_nodes=budget, max_depth=depth))
    params = SamplingParams(max_new_tokens=new)
    outs, walls = [], []
    for p in prompts:
        start = time.perf_counter()
        outs += engine.generate([encode_prompt(tok, p.text, chat=True)], params, request_ids=[p.id])
        walls.append(time.perf_counter() - start)
    st = engine.speculator.stats
    return outs, walls, {"draft_s": st.draft_s, "verify_s": st.forward_s + st.accept_s}


def _summary(spec: str, outs: list, walls: list, prompts: list, timing: dict) -> dict[str, Any]:
    tokens, steps, wall = sum(len(o.token_ids) for o in outs), sum(o.steps for o in outs), sum(walls)
    depth_seen = max(len(o.accepted_per_depth) for o in outs)
    by_cat = {}
    for cat in CATEGORIES:
        sel = [o for o, p in zip(outs, prompts) if p.category == cat]
        if sel:
            by_cat[cat] = round(sum(o.step_tokens for o in sel) / sum(o.steps for o in sel), 3)
    return {
        "drafter": spec, "tokens": tokens, "steps": steps, "tau": round(sum(o.step_tokens for o in outs) / steps, 4),
        "tokens_per_s": round(tokens / wall, 3), "wall_s": round(wall, 2),
        "draft_s": round(timing["draft_s"], 3), "verify_s": round(timing["verify_s"], 3),
        "accepted_per_depth": [round(sum(o.accepted_per_depth[d] for o in outs if d < len(o.accepted_per_depth))
                                     / steps, 4) for d in range(depth_seen)],
        "tau_by_category": by_cat,
    }


@torch.no_grad()
def _agreement(model, tok, heads: HydraHeads, prompts: list, outputs: dict) -> dict[str, Any]:
    """Per-head top-1/top-5 agreement with the target's own greedy tokens (teacher-forced), plus
    the chain tau that follows (:func:`heads_compare.score`)."""
    seqs = []
    for p in prompts:
        prompt = encode_prompt(tok, p.text, chat=True)
        seq = prompt + outputs[p.id]
        hidden = model(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0].float()
        if heads.prefix is not None:  # Hydra++: the heads read the prefix layer's causal output
            hidden = heads.prefix_forward(hidden[None], torch.arange(len(seq))[None])[0][0]
        seqs.append((len(prompt), torch.tensor(seq), hidden))
    return score(heads, seqs)


def _vocab_tradeoff(heads: HydraHeads, lm_head: torch.Tensor, plain_outs: list) -> dict[str, Any]:
    tokens = torch.tensor([t for o in plain_outs for t in o.token_ids])
    covered = torch.isin(tokens, heads.token_map).float().mean().item() if heads.config.reduced_vocab else 1.0
    h = torch.randn(16, heads.config.hidden_size)

    def cost(weight: torch.Tensor) -> float:
        z = heads.heads[0](torch.cat([h, h], dim=1))
        start = time.perf_counter()
        for _ in range(20):
            torch.softmax(z @ weight.T, dim=-1).topk(4)
        return round((time.perf_counter() - start) / 20 * 1e3, 3)

    return {"reduced_vocab": heads.config.reduced_vocab, "coverage_of_target_tokens": round(covered, 4),
            "head_output_ms_16_nodes": {"reduced": cost(heads.out_weight), "full": cost(lm_head.float())}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", nargs="+", default=[str(SHIPPED_HEADS)],
                    help="Hydra checkpoint(s) (default: shipped); the first is 'hydra' in the agreement table, "
                    "others by directory name")
    ap.add_argument("--independent-heads", default=None, help="the --independent ablation checkpoint")
    ap.add_argument("--prefix-heads", default=None, help="a --prefix-attention (Hydra++) checkpoint")
    ap.add_argument("--prompts", default=str(SPEC_BENCH))
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--mt-bench-extra", type=int, default=6, help="extra MT-Bench prompts for agreement")
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--budget", type=int, default=16, help="draft nodes per tree (all drafters)")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=str(result_path("hydra_eval", machine_kind(), "fp32")))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2", torch.float32)
    tau_set, agree_set = _pick(Path(args.prompts), args.per_category, args.mt_bench_extra)
    extra = [p for p in agree_set if p not in tau_set]

    plain_outs, plain_walls, timing = _run(model, tok, "none", tau_set + extra, args.budget, args.depth, args.new_tokens)
    reference = {o.request_id: o.token_ids for o in plain_outs}
    n_tau = len(tau_set)
    plain = _summary("none", plain_outs[:n_tau], plain_walls[:n_tau], tau_set, timing)
    runs = [plain]
    specs = ([f"hydra:{h}" for h in args.heads] + ["ngram"]
             + [f"hydra:{p}" for p in (args.independent_heads, args.prefix_heads) if p])
    for spec in specs:
        outs, walls, timing = _run(model, tok, spec, tau_set, args.budget, args.depth, args.new_tokens)
        run = _summary(spec, outs, walls, tau_set, timing)
        run["identical_to_plain"] = round(sum(o.token_ids == reference[o.request_id] for o in outs) / len(outs), 4)
        run["speedup"] = round(run["tokens_per_s"] / plain["tokens_per_s"], 4)
        runs.append(run)

    target = hf_target(model, tok, "smollm2")
    ident, embed, lm_head = TargetIdentity.of(target), target.embed, target.lm_head
    agreement = {}
    named = [("hydra", args.heads[0])] + [(Path(h).name, h) for h in args.heads[1:]]
    for name, path in (*named, ("independent", args.independent_heads), ("prefix", args.prefix_heads)):
        if path:
            heads = load_heads(path, ident, embed, lm_head)
            agreement[name] = {"config": {k: v for k, v in json.loads((Path(path) / "config.json").read_text()).items()
                                          if k != "target"},
                               **_agreement(model, tok, heads, agree_set, reference)}
    tradeoff = _vocab_tradeoff(load_heads(args.heads[0], ident, embed, lm_head), lm_head, plain_outs[:n_tau])
    doc = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": f"cpu ({platform.machine()}, {torch.get_num_threads()} threads, shared)",
        "model": "SmolLM2-135M-Instruct", "dtype": "fp32", "greedy": True, "batch_size": 1,
        "new_tokens": args.new_tokens, "node_budget": args.budget, "max_depth": args.depth,
        "tau_prompts": [p.id for p in tau_set], "agreement_prompts": [p.id for p in agree_set],
        "runs": runs, "agreement_mt_bench": agreement, "vocab_tradeoff": tradeoff,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: doc[k] for k in ("agreement_mt_bench", "vocab_tradeoff")}, indent=1))
    for r in runs:
        print(f"{r['drafter']:<50} tau={r['tau']:.3f} tok/s={r['tokens_per_s']:.2f} "
              f"identical={r.get('identical_to_plain', 1.0)} by_cat={r['tau_by_category']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
