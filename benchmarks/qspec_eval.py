"""Quantized self-draft evaluation on SmolLM2-135M (CPU): agreement, tau, losslessness, speed.

For each Spec-Bench category (MT-Bench's first turns pooled as ``mt_bench``) takes the first
``--per-category`` prompts (chat template), decodes them greedily (as one batch) with plain
decoding and with the ``qspec`` self-draft at each precision, and reports per spec and category:

* ``agreement``: fraction of steps whose depth-1 draft (the draft's top-1 token after the root,
  computed on the target's exact prefix KV) the target accepted: per-token top-1 agreement;
* ``agreement_all_depths``: accepted drafts / drafts whose ancestors were all accepted, pooled over
  depths (deeper drafts also read the draft's own KV for the drafted tokens);
* ``tau``: mean tokens committed per target forward (bonus included); ``accepted_per_depth``;
* ``identical``: whether every output equals plain greedy decoding token for token (fp32);
* ``tokens_per_s`` and ``speed_ratio`` (plain wall time / self-draft wall time), on this CPU.

The loop is category-major (every spec for one category, then the next category) and the JSON is
rewritten after every cell, so a run that is cut short keeps all finished cells.

Grid: SmolLM2's weights are a dequantized Q4_1 GGUF (asymmetric int4, blocks of 32). The main
specs use *symmetric* group-128 quantization, a different grid, so acceptance is not inflated by
re-quantizing onto the source grid; ``w4a16,g32,asym`` (the GGUF's own grid) is run last to show the
inflation.

CPU caveat: the draft is the whole model in low precision, so one draft forward costs about one
target forward here (the CPU has no int4 matmul; the torch path dequantizes). Draft weights are
materialized (dequantized once, the same numbers) so acceptance can be measured in reasonable time;
``--reference-path`` times the on-the-fly dequantization path instead. A chain of depth ``d``
costs ``d`` draft forwards + 1 verify forward per step, so on this CPU the self-draft is slower
than plain decoding unless tau > d + 1 (impossible); the tokens/s ratios show that cost. The benefit
of the design (4x fewer weight bytes per draft forward) needs the GPU W4A16 kernel.

    OMP_NUM_THREADS=1 python benchmarks/qspec_eval.py [--per-category 2] [--max-new-tokens 32]
    python benchmarks/qspec_eval.py --report benchmarks/results/qspec_eval/cpu_fp32.json  # table + PNG

``--grid-check`` loads the model, measures how far each weight grid is from the target's weights
(relative Frobenius error of a round trip, per linear kind, next to an exact re-quantization onto
the GGUF's Q4_1 grid: float block minimum, 16 levels) and merges it into the JSON as ``grid_check``.
``--report`` loads no model: it prints the markdown table (agreement / tau per spec and category)
and writes the plot beside the JSON. The result goes to ``benchmarks/results/qspec_eval/<machine>_fp32.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from dyntree.common.config import SamplingParams, SpecConfig
from dyntree.common.drafter import NoDrafter
from dyntree.common.drafters.qspec import QSpecDrafter
from dyntree.common.quant import QSpec, dequantize_weight, parse_qspec, quantize_weight
from dyntree.models import load_model, machine_kind
from dyntree.standalone.bench import _device, _versions, encode_prompt, load_prompts
from dyntree.standalone.engine import RequestOutput, SpecEngine
from results_index import result_path  # benchmarks/ is on sys.path when run as a script

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
SPECS = ["w8a16,g128,sym", "w4a16,g128,sym", "w4a8,g128,sym", "w4a4,g128,sym", "w4a16,g32,asym"]
CATEGORIES = ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]


def _prompts(path: Path, per_category: int) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {c: [] for c in CATEGORIES}
    for p in load_prompts(path):
        cat = p.category if p.category in CATEGORIES else "mt_bench"
        if len(out[cat]) < per_category:
            out[cat].append(p.text)
    return out


def _run(engine: SpecEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[RequestOutput], float]:
    engine.speculator.stats.reset()  # an engine decodes several cells: time this one only
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    return outs, time.perf_counter() - t0


def _cell(spec: QSpec, cat: str, outs: list[RequestOutput], wall: float, plain: list[RequestOutput],
          plain_wall: float, depth: int, engine: SpecEngine) -> dict[str, Any]:
    stats = engine.speculator.stats  # reset by _run: this cell's generate only
    steps = sum(o.steps for o in outs)
    tokens = sum(len(o.token_ids) for o in outs)
    acc = [sum(o.accepted_per_depth[d] for o in outs if d < len(o.accepted_per_depth)) for d in range(depth)]
    tried = [steps] + acc[:-1]  # drafts at depth d whose ancestors were all accepted
    return {
        "spec": str(spec),
        "category": cat,
        "prompts": len(outs),
        "tokens": tokens,
        "steps": steps,
        "agreement": round(acc[0] / steps, 4),
        "agreement_all_depths": round(sum(acc) / sum(tried), 4),
        "tau": round(sum(o.step_tokens for o in outs) / steps, 4),
        "accepted_per_depth": [round(a / steps, 4) for a in acc],
        "identical": [o.token_ids for o in outs] == [o.token_ids for o in plain],
        "tokens_per_s": round(tokens / wall, 3),
        "plain_tokens_per_s": round(sum(len(o.token_ids) for o in plain) / plain_wall, 3),
        "speed_ratio": round(plain_wall / wall, 4),
        "draft_s": round(stats.draft_s, 3),  # plan, draft forwards, tree building
        "verify_s": round(stats.forward_s + stats.accept_s, 3),  # verify forwards and acceptance
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def _write(path: Path, result: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(path)


def _q4_1_round_trip(w: torch.Tensor) -> torch.Tensor:
    """``w`` re-quantized onto GGUF Q4_1's grid: blocks of 32 along the input, ``w ~ q * d + m``
    with ``m`` the block minimum, ``d = (max - min) / 15`` (both stored in fp16), ``q`` in 0..15."""
    blocks = w.float().reshape(w.shape[0], -1, 32)
    lo, hi = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    d = ((hi - lo) / 15).half().float()
    m = lo.half().float()
    q = torch.round((blocks - m) / d.clamp_min(1e-12)).clamp(0, 15)
    return (q * d + m).reshape(w.shape)


def grid_check(model: torch.nn.Module, specs: list[QSpec]) -> dict[str, dict[str, float]]:
    """Mean relative round-trip error ``|deq(q(W)) - W| / |W|`` per linear kind and grid."""
    errs: dict[str, dict[str, list[float]]] = {}
    for name, mod in model.get_decoder().layers.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        w = mod.weight.detach().float()
        mine = errs.setdefault(name.rsplit(".", 1)[-1], {})
        grids = {f"w{s.weight_bits},{'perchannel' if s.group_size is None else f'g{s.group_size}'},"
                 f"{'sym' if s.symmetric else 'asym'}": s for s in specs if s.quantized}
        for tag, s in grids.items():
            q = dequantize_weight(quantize_weight(w, s.weight_bits, s.group_size, s.symmetric), torch.float32)
            mine.setdefault(tag, []).append(float((q - w).norm() / w.norm()))
        mine.setdefault("q4_1 (GGUF grid, float minimum)", []).append(float((_q4_1_round_trip(w) - w).norm() / w.norm()))
    return {kind: {tag: round(sum(v) / len(v), 6) for tag, v in d.items()} for kind, d in errs.items()}


def report(path: Path) -> str:
    """Markdown table of a result JSON: ``agreement / tau`` per spec and category; pooled over
    categories, the measured CPU speed ratio (plain wall time / self-draft wall time), a
    load-robust estimate of it from the run's own mean draft and verify forward times (a plain
    token costs about one draft forward: one token through the same dense fp32 weights; a step
    costs ``depth`` draft forwards + one verify), and those times. Writes the plot to ``<path>.png``."""
    result = json.loads(path.read_text())
    rows = result["rows"]
    specs = list(dict.fromkeys(r["spec"] for r in rows))
    cats = [c for c in CATEGORIES if any(r["category"] == c for r in rows)]
    cell = {(r["spec"], r["category"]): r for r in rows}
    lines = ["| spec | " + " | ".join(cats) + " | all | identical | tokens/s vs plain | est. from fwd costs "
             "| draft / verify fwd (s) |", "|---|" + "---|" * (len(cats) + 5)]
    for spec in specs:
        mine = [r for r in rows if r["spec"] == spec]
        steps = sum(r["steps"] for r in mine)
        depth = len(mine[0]["accepted_per_depth"])
        draft_fwd = sum(r["draft_s"] for r in mine) / (steps * depth)
        verify_fwd = sum(r["verify_s"] for r in mine) / steps
        tokens = sum(r["tokens"] for r in mine)
        wall = sum(r["tokens"] / r["tokens_per_s"] for r in mine)
        plain_wall = sum(r["tokens"] / r["plain_tokens_per_s"] for r in mine)  # identical outputs: same count
        # load-robust estimate: a plain token costs one 1-token forward of the same dense fp32
        # weights, i.e. about one draft forward (materialized, no skipped layers); a step costs
        # depth draft forwards + one verify forward
        tau = sum(r["tau"] * r["steps"] for r in mine) / steps
        est = tau * draft_fwd / (depth * draft_fwd + verify_fwd)
        vals = [f"{cell[spec, c]['agreement']:.2f} / {cell[spec, c]['tau']:.2f}" if (spec, c) in cell else "-" for c in cats]
        vals.append(f"{sum(r['agreement'] * r['steps'] for r in mine) / steps:.2f} / {tau:.2f}")
        ident = all(r["identical"] for r in mine)
        lines.append(f"| {spec} | " + " | ".join(vals) + f" | {'yes' if ident else 'NO'} | x{plain_wall / wall:.2f} | "
                     f"x{est:.2f} | {draft_fwd:.2f} / {verify_fwd:.2f} |")
    _plot(path.with_suffix(".png"), rows, specs, cats)
    return "\n".join(lines)


def _plot(path: Path, rows: list[dict[str, Any]], specs: list[str], cats: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cell = {(r["spec"], r["category"]): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(specs)
    for k, spec in enumerate(specs):
        xs = [i + (k - (len(specs) - 1) / 2) * width for i in range(len(cats))]
        for ax, key in zip(axes, ("agreement", "tau")):
            ax.bar(xs, [cell[spec, c][key] if (spec, c) in cell else 0.0 for c in cats], width, label=spec)
    for ax, title in zip(axes, ("depth-1 agreement with the target", "tau (tokens per target forward)")):
        ax.set_xticks(range(len(cats)), cats, rotation=20)
        ax.set_title(title)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(specs), fontsize=8)
    fig.suptitle("qspec self-draft, SmolLM2-135M fp32, greedy, chain depth 4")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--depth", type=int, default=4, help="draft chain length per step")
    ap.add_argument("--specs", nargs="+", default=SPECS)
    ap.add_argument("--categories", nargs="+", default=CATEGORIES, choices=CATEGORIES)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (oversubscription is slow)")
    ap.add_argument("--reference-path", action="store_true", help="dequantize on the fly (slow) instead of materializing")
    ap.add_argument("--out", type=Path, default=result_path("qspec_eval", machine_kind(), "fp32"))
    ap.add_argument("--report", type=Path, help="print the table of this result JSON, write its PNG, and exit")
    ap.add_argument("--grid-check", action="store_true", help="add the weight grids' round-trip errors to --out and exit")
    args = ap.parse_args(argv)
    if args.report is not None:
        print(report(args.report))
        return 0
    specs = [parse_qspec(s) for s in args.specs]  # fail fast on a bad spec
    torch.set_num_threads(args.threads)

    t_start = time.perf_counter()
    model, tok = load_model("smollm2", torch.float32)
    if args.grid_check:
        result = json.loads(args.out.read_text())
        result["grid_check"] = grid_check(model, specs)
        _write(args.out, result)
        print(json.dumps(result["grid_check"], indent=1))
        return 0
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    cfg = SpecConfig(drafter="qspec", max_nodes=args.depth, max_depth=args.depth)
    by_cat = _prompts(args.data, args.per_category)
    encoded = {c: [encode_prompt(tok, t, chat=True) for t in by_cat[c]] for c in args.categories}
    # one engine per spec, reused for every category (its draft layers are quantized once); the
    # engine attaches its HF self-draft backend, which holds the draft weights and their memory
    engines = {str(s): SpecEngine(model, tok, QSpecDrafter(s, topk=1, width=1), cfg,
                                  materialize_draft=not args.reference_path) for s in specs}
    rows: list[dict[str, Any]] = []
    result = {
        "benchmark": "qspec self-draft on SmolLM2-135M-Instruct (fp32), Spec-Bench first-turn prompts",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": _device(),
        "versions": _versions(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "settings": {"per_category": args.per_category, "max_new_tokens": args.max_new_tokens,
                     "prompt_lengths": {c: [len(p) for p in ps] for c, ps in encoded.items()},
                     "tree": f"chain, depth {args.depth} (the drafter's own tree, topk=1, width=1)", "greedy": True,
                     "batch": "a category's prompts decode together as one batch",
                     "draft_weights": "on-the-fly dequantization" if args.reference_path else "materialized (same numbers)",
                     "grid": "symmetric int, group 128 for the main specs; w4a16,g32,asym = the source "
                             "GGUF's own grid (Q4_1: asymmetric int4, blocks of 32), shown for the inflation",
                     "activations": "symmetric per-token fake quantization (a8 / a4)",
                     "lm_head": "shared, unquantized"},
        "memory": {name: {"draft_weight_bytes": sum(m.quantized_weight.nbytes for m in e.drafter.backend.quant_layers),
                          "target_param_bytes": e.drafter.backend.target_bytes}
                   for name, e in engines.items()},
        "complete": False,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for cat, prompts in encoded.items():
        plain_engine = SpecEngine(model, tok, NoDrafter(), cfg)
        plain, plain_wall = _run(plain_engine, prompts, params)
        print(f"{'plain':18s} {cat:15s} {sum(len(o.token_ids) for o in plain) / plain_wall:.2f} tok/s", flush=True)
        for name, engine in engines.items():
            outs, wall = _run(engine, prompts, params)
            rows.append(_cell(engine.drafter.spec, cat, outs, wall, plain, plain_wall, args.depth, engine))
            result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
            _write(args.out, result)
            r = rows[-1]
            print(f"{name:18s} {cat:15s} agree {r['agreement']:.3f} tau {r['tau']:.2f} "
                  f"identical {r['identical']} speed x{r['speed_ratio']:.2f} load {r['loadavg_1m']}", flush=True)
    result["complete"] = True
    result["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    _write(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
