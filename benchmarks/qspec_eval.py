"""Quantized self-draft evaluation on SmolLM2-135M (CPU): agreement, tau, losslessness, speed.

For each Spec-Bench category (MT-Bench's first turns pooled as ``mt_bench``) takes the first
``--per-category`` prompts (chat template), decodes them greedily with plain decoding and with the
``qspec`` self-draft at several precisions, and reports per spec and category:

* ``agreement``: fraction of steps whose depth-1 draft (the draft's top-1 token after the root;
  chain trees) the target accepted, i.e. per-token top-1 agreement at the steps' root positions;
* ``tau``: mean tokens committed per target forward; ``accepted_per_depth``;
* ``identical``: whether every output equals plain greedy decoding token for token;
* ``tokens_per_s`` and the ratio to plain decoding, on this CPU.

Grid: the weights are a dequantized Q4_1 GGUF (asymmetric int4, blocks of 32). All specs here
use *symmetric* quantization with group 128 (or per-channel for int8 where stated), a grid that
differs from Q4_1, so acceptance is not inflated by re-quantizing onto the source grid.

CPU caveat: the draft is the whole model in low precision, so per forward it costs about what the
target costs here (the CPU has no int4 matmul; the torch path dequantizes). Draft weights are
materialized (dequantized once, same numbers) so acceptance can be measured in reasonable time;
``--reference-path`` times the on-the-fly dequantization path instead. A speedup needs the GPU
W4A16 kernel (weight reads 4x smaller); tokens/s ratios here show the cost, not the benefit.

    python benchmarks/qspec_eval.py [--per-category 1] [--max-new-tokens 48]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path

import torch

from dyntree.common.config import SamplingParams, SpecConfig
from dyntree.common.drafter import NoDrafter
from dyntree.common.quant import parse_qspec
from dyntree.models import load_model
from dyntree.standalone.bench import _device, _versions, encode_prompt, load_prompts
from dyntree.standalone.engine import SpecEngine
from dyntree.standalone.qspec import QSpecDrafter

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
SPECS = ["w8a16,g128", "w4a16,g128,sym", "w4a8,g128", "w4a4,g128"]
CATEGORIES = ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]


def _prompts(path: Path, per_category: int) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {c: [] for c in CATEGORIES}
    for p in load_prompts(path):
        cat = p.category if p.category in CATEGORIES else "mt_bench"
        if len(out[cat]) < per_category:
            out[cat].append(p.text)
    return out


def _run(engine: SpecEngine, prompts: list[list[int]], params: SamplingParams):
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    return outs, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--depth", type=int, default=4, help="draft chain length per step")
    ap.add_argument("--specs", nargs="+", default=SPECS)
    ap.add_argument("--reference-path", action="store_true", help="dequantize on the fly (slow) instead of materializing")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "qspec_eval.json")
    args = ap.parse_args(argv)
    specs = [parse_qspec(s) for s in args.specs]  # fail fast on a bad spec

    model, tok = load_model("smollm2", torch.float32)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    cfg = SpecConfig(drafter="qspec", max_nodes=args.depth, max_depth=args.depth)
    by_cat = _prompts(args.data, args.per_category)
    encoded = {c: [encode_prompt(tok, t, chat=True) for t in texts] for c, texts in by_cat.items()}

    plain_engine = SpecEngine(model, tok, NoDrafter(), cfg)
    plain = {c: _run(plain_engine, ps, params) for c, ps in encoded.items()}
    rows = []
    for spec in specs:
        drafter = QSpecDrafter(model, spec, topk=1, width=1, materialize=not args.reference_path)
        overhead = sum(m.quantized_weight.nbytes for m in drafter.quant_layers)
        engine = SpecEngine(model, tok, drafter, cfg)
        for cat, prompts in encoded.items():
            outs, wall = _run(engine, prompts, params)
            base_outs, base_wall = plain[cat]
            steps = sum(o.steps for o in outs)
            tokens = sum(len(o.token_ids) for o in outs)
            depth = [sum(o.accepted_per_depth[d] for o in outs if d < len(o.accepted_per_depth)) / steps for d in range(args.depth)]
            rows.append({
                "spec": str(spec),
                "category": cat,
                "prompts": len(prompts),
                "tokens": tokens,
                "steps": steps,
                "agreement": round(depth[0], 4),
                "tau": round(tokens / steps, 4),
                "accepted_per_depth": [round(x, 4) for x in depth],
                "identical": [o.token_ids for o in outs] == [o.token_ids for o in base_outs],
                "tokens_per_s": round(tokens / wall, 3),
                "plain_tokens_per_s": round(sum(len(o.token_ids) for o in base_outs) / base_wall, 3),
                "speed_ratio": round(base_wall / wall, 4),
                "draft_s": round(engine.timing["draft_s"], 3),
                "verify_s": round(engine.timing["verify_s"], 3),
            })
            engine.timing = {"draft_s": 0.0, "verify_s": 0.0}
            r = rows[-1]
            print(f"{r['spec']:18s} {cat:15s} agree {r['agreement']:.3f} tau {r['tau']:.2f} "
                  f"identical {r['identical']} speed x{r['speed_ratio']:.2f}", flush=True)
        rows.append({"spec": str(spec), "category": "_memory", "draft_weight_bytes": overhead,
                     "target_param_bytes": drafter.target_bytes,
                     "overhead_vs_fp32_target": round(overhead / drafter.target_bytes, 4),
                     "overhead_vs_bf16_target": round(overhead / (drafter.target_bytes / 2), 4)})
    result = {
        "benchmark": "qspec self-draft on SmolLM2-135M-Instruct (fp32), Spec-Bench first-turn prompts",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": _device(),
        "versions": _versions(),
        "settings": {"per_category": args.per_category, "max_new_tokens": args.max_new_tokens,
                     "tree": f"chain, depth {args.depth} (topk=1, width=1)", "greedy": True,
                     "draft_weights": "on-the-fly dequantization" if args.reference_path else "materialized (same numbers)",
                     "grid": "symmetric int, group 128 (source weights: Q4_1 asym blocks of 32)",
                     "lm_head": "shared, unquantized"},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
