"""Tree modes at equal node budgets on Spec-Bench: ``chain`` vs ``static`` vs ``dyntree`` per drafter.

For each drafter (default: ``ngram``; any drafter spec with ``expand`` can be added
with ``--drafters``, space-separated, e.g. ``hydra hydra:DIR,table=off``; one without it runs mode
``own`` only) and each node budget (16, 32, 64), every tree mode decodes the same Spec-Bench
prompts (spread over all categories, or ``--categories`` only: ``coding``, ``mt_bench`` = the 80
MT-Bench questions, ...) at batch size 1,
on the CPU by default or on a GPU with ``--device cuda``. Reports tau, tokens/s, speedup over plain decoding, accepted tokens per depth,
the share of outputs identical to plain decoding (bf16: not exact, see docs/design.md), and the
tree-building overhead per step (ms and % of step time). The ``summary`` block gives, per drafter
and budget, dyntree's tau over the best of ``static`` and ``chain`` (each dyntree variant). Writes
``benchmarks/results/tree_eval/<machine>_<dtype>_<drafters>.json`` and the plot beside it.

``--groups coding:10,mt_bench:16,summarization:8`` runs several prompt groups in one run (their
union, each prompt once) and reports tau and the summary per group, next to issue 14's tau
targets for Hydra at 16 nodes (``TAU_TARGETS``).

    python benchmarks/modes_eval.py --prompts 3 --new 24 --budgets 16,64 --modes chain,static,dyntree
    python benchmarks/modes_eval.py --categories coding --drafters hydra "hydra:DIR,table=off" --dtype fp32
    python benchmarks/modes_eval.py --groups coding:10,mt_bench:16 --drafters hydra ngram qspec --dtype fp32
"""

from __future__ import annotations

import argparse
import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path

import torch

from dyntree.common.config import SamplingParams, SpecConfig
from dyntree.common.options import TreeOptions
from dyntree.models import load_model, machine_kind, parse_dtype, resolve_device
from dyntree.standalone.bench import _device, _versions, compare, encode_prompt, load_prompts, run_mode
from dyntree.standalone.target import make_hf_drafter
from results_index import result_path  # benchmarks/ is on sys.path when run as a script

SPEC_BENCH = Path(os.environ.get("DYNTREE_SHARED", Path(__file__).resolve().parents[2] / "shared")) / "data/spec_bench/question.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8, help="Spec-Bench prompts (spread over categories)")
    ap.add_argument("--new", type=int, default=40, help="new tokens per prompt")
    ap.add_argument("--budgets", default="16,32,64")
    ap.add_argument("--drafters", nargs="+", default=["ngram"], help="drafter specs, space-separated")
    ap.add_argument("--categories", default="",
                    help="comma-separated Spec-Bench categories (mt_bench = the 80 MT-Bench questions); default all")
    ap.add_argument("--groups", default="",
                    help="comma-separated CATEGORY:N prompt groups, reported apart (replaces --categories / --prompts)")
    ap.add_argument("--modes", default="own,chain,static,dyntree", help="modes of a drafter with expand")
    ap.add_argument(
        "--dyntree-thresholds", default="",
        help="comma-separated path-value thresholds: run dyntree once per value (default: the option's "
        "default); 0 fills the node budget, for a comparison at equal node counts",
    )
    ap.add_argument("--max-children", type=int, default=None, help="dyntree: most children of one node")
    ap.add_argument("--tree-options", type=json.loads, default={},
                    help='dyntree: more tree builder options as JSON, e.g. \'{"max_frontier": 64}\'')
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--dtype", default="bf16", help="fp32 (exact), bf16 or fp16")
    ap.add_argument("--out", default=None, help="default benchmarks/results/tree_eval/<machine>_<dtype>_<drafters>.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    every = load_prompts(SPEC_BENCH)
    groups = pick_groups(every, args.groups) if args.groups else {
        args.categories or "all": spread(select(every, args.categories), args.prompts)}
    model, tok = load_model("smollm2", parse_dtype(args.dtype), resolve_device(args.device))
    prompts = list({p.id: p for members in groups.values() for p in members}.values())
    encoded = [encode_prompt(tok, p.text, chat=True) for p in prompts]
    ids = [p.id for p in prompts]
    members = {name: {p.id for p in group} for name, group in groups.items()}
    params = SamplingParams(max_new_tokens=args.new)
    base = run_mode(model, tok, encoded, ids, "none", SpecConfig(drafter="none"), params, 1, groups=members)
    compare(base, base)
    runs = [base]
    thresholds = [float(t) for t in args.dyntree_thresholds.split(",") if t]
    for drafter in args.drafters:
        builder = make_hf_drafter(drafter, model, tok).drafts_with_builder
        for budget in (int(b) for b in args.budgets.split(",")):
            spec = SpecConfig(drafter=drafter, max_nodes=budget, max_depth=min(8, budget))
            for mode, s in variants(args.modes.split(",") if builder else ["own"], spec, thresholds, args.max_children,
                                    args.tree_options):
                run = run_mode(model, tok, encoded, ids, mode, s, params, 1, groups=members)
                compare(base, run)
                run["threshold"] = s.tree_options.threshold if mode == "dyntree" else None
                run["max_children"] = s.tree_options.max_children if mode == "dyntree" else None
                if mode == "dyntree" and args.tree_options:
                    run["tree_options"] = args.tree_options
                runs.append(run)
                print(f"{drafter:8} N={budget:<3} {mode:8} thr={run['threshold']} tau={run['tau']:.2f} "
                      f"({', '.join(f'{g} {t:.2f}' for g, t in run['by_category'].items())}) "
                      f"nodes={run['draft_nodes_per_step']:.1f} tok/s={run['tokens_per_s']:.2f} "
                      f"speedup={run['speedup']:.2f} draft={run['draft_ms_per_step']:.1f}ms "
                      f"build={run['build_ms_per_step']}ms ({run['build_pct_of_step']}%)", flush=True)
    for r in runs:
        r.pop("outputs")
    doc = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": _device() if args.device != "cpu" else f"cpu ({args.threads} threads)", "versions": _versions(),
        "dtype": args.dtype, "threads": args.threads,
        "load_avg_start": [round(x, 2) for x in load_start], "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        "note": "wall-clock numbers depend on the machine's load (load_avg_start / _end); tau does not",
        "categories": args.categories or "all", "groups": {name: sorted(m) for name, m in members.items()},
        "prompt_ids": ids,
        "num_prompts": len(prompts), "max_new_tokens": args.new, "batch_size": 1,
        "summary": summarize(runs), "runs": runs,
    }  # fmt: skip
    for line in doc["summary"]:
        print(line)
    setting = re.sub(r"[^A-Za-z0-9]+", "-", " ".join(args.drafters)).strip("-")
    out = Path(args.out) if args.out else result_path("tree_eval", machine_kind(resolve_device(args.device)),
                                                      args.dtype, setting)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    plot(doc, out.with_suffix(".png"))
    print(f"wrote {out}")


MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def select(prompts: list, categories: str) -> list:
    """The prompts of the comma-separated ``categories`` (``mt_bench``: its eight); all if empty."""
    want = {c.strip() for c in categories.split(",") if c.strip()}
    if "mt_bench" in want:
        want = (want - {"mt_bench"}) | set(MT_BENCH)
    out = [p for p in prompts if not want or p.category in want]
    if not out:
        raise SystemExit(f"no Spec-Bench prompt has a category in {sorted(want)}")
    return out


def pick_groups(prompts: list, spec: str) -> dict[str, list]:
    """``CATEGORY:N,...`` -> per group its N prompts, spread evenly over the category's
    (:func:`select`; ``all``: every category)."""
    groups = {}
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        name, _, n = item.partition(":")
        if not n.isdigit() or int(n) < 1 or name in groups:
            raise SystemExit(f"--groups: {item!r} must be CATEGORY:N with N >= 1, each category once")
        groups[name] = spread(select(prompts, "" if name == "all" else name), int(n))
    return groups


def spread(prompts: list, n: int) -> list:
    """``n`` of ``prompts``, evenly spaced from the first."""
    return prompts[:: max(1, len(prompts) // n)][:n]


TAU_TARGETS = {"coding": 2.5, "mt_bench": 2.2}  # issue 14: the shipped Hydra heads at 16 nodes


def summarize(runs: list[dict]) -> list[str]:
    """Per group, drafter and budget: each dyntree variant's tau against the best of static and
    chain; and Hydra's dyntree tau at 16 nodes against :data:`TAU_TARGETS`."""
    lines = []
    groups = list(runs[0].get("by_category") or {"all": None}) if runs else []
    keys = sorted({(r["drafter"], r["max_nodes"]) for r in runs if r["mode"] == "dyntree"}, key=str)
    for group in groups:
        def tau(r: dict) -> float:
            return r["by_category"][group] if r.get("by_category") else r["tau"]

        where = f" [{group}]" if len(groups) > 1 or group != "all" else ""
        for drafter, budget in keys:
            same = [r for r in runs if r["drafter"] == drafter and r["max_nodes"] == budget]
            fixed = [r for r in same if r["mode"] in ("static", "chain")]
            if not fixed:
                continue
            best = max(fixed, key=tau)
            for r in (r for r in same if r["mode"] == "dyntree"):
                ratio = tau(r) / tau(best)
                lines.append(f"{drafter} N={budget} dyntree thr={r['threshold']}{where}: tau {tau(r):.3f} = "
                             f"{ratio:.3f}x the best fixed shape ({best['mode']} {tau(best):.3f}); target >= 1.10x: "
                             f"{'met' if ratio >= 1.10 else 'not met'}")
                if drafter.split(":")[0] == "hydra" and budget == 16 and group in TAU_TARGETS:
                    goal = TAU_TARGETS[group]
                    lines.append(f"{drafter} N=16 dyntree thr={r['threshold']}{where}: tau {tau(r):.3f}; "
                                 f"target >= {goal}: {'met' if tau(r) >= goal else 'not met'}")
    return lines


def variants(
    modes: list[str], spec: SpecConfig, thresholds: list[float], max_children: int | None = None,
    tree_options: dict | None = None,
) -> list[tuple[str, SpecConfig]]:
    """(mode, config) pairs to run: ``dyntree`` once per path-value threshold (none: the default),
    with ``max_children`` and the other ``tree_options`` when given."""
    out = []
    for mode in modes:
        for t in thresholds if mode == "dyntree" and thresholds else [None]:
            fields = spec.model_dump(exclude_unset=True)
            tree = fields.setdefault("tree_options", {})
            if t is not None:
                tree["threshold"] = t
            if mode == "dyntree" and max_children is not None:
                tree["max_children"] = max_children
            if mode == "dyntree":
                tree.update(tree_options or {})
            out.append((mode, SpecConfig.model_validate(fields)))
    return out


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(r: dict) -> str:  # dyntree runs at several thresholds / widths are separate series
        t, k = r.get("threshold"), r.get("max_children")
        label = r["mode"] if t is None else f"{r['mode']} thr={t:g}"
        return label if k in (None, TreeOptions().max_children) else f"{label} k<={k}"

    runs = [r for r in doc["runs"] if r["mode"] != "none"]
    budgets = sorted({r["max_nodes"] for r in runs})
    modes = sorted({series(r) for r in runs}, key=lambda m: (["own", "chain", "static", "dyntree"].index(m.split()[0]), m))
    drafters = sorted({r["drafter"] for r in runs})
    groups = list(doc.get("groups") or {})
    groups = groups if len(groups) > 1 else []  # one group: its tau is the run's
    cols = max(3, len(groups))
    fig, grid = plt.subplots(2 if groups else 1, cols, figsize=(5 * cols, 8 if groups else 4), squeeze=False)
    axes, group_axes = grid[0], grid[1][: len(groups)] if groups else []
    for ax in list(grid[0][3:]) + (list(grid[1][len(groups):]) if groups else []):
        ax.set_visible(False)
    width = 0.8 / max(1, len(modes) * len(drafters))
    for k, (d, m) in enumerate((d, m) for d in drafters for m in modes):
        sel = {r["max_nodes"]: r for r in runs if r["drafter"] == d and series(r) == m}
        xs = [i + k * width for i, b in enumerate(budgets) if b in sel]
        style = {"label": f"{d}/{m}", "color": plt.cm.tab20(k % 20)}
        axes[0].bar(xs, [sel[b]["tau"] for b in budgets if b in sel], width, **style)
        axes[1].bar(xs, [sel[b]["speedup"] for b in budgets if b in sel], width, **style)
        axes[2].bar(xs, [sel[b]["build_pct_of_step"] or 0.0 for b in budgets if b in sel], width, **style)
        for ax, g in zip(group_axes, groups):
            ax.bar(xs, [sel[b]["by_category"][g] for b in budgets if b in sel], width, **style)
    titles = ["tau (tokens per target forward)", "speedup over plain (tokens/s)",
              "tree-builder overhead (% of step; own: no builder)"]
    titles += [f"tau on {g} ({len(doc['groups'][g])} prompts)" for g in groups]
    for ax, title in zip(list(axes[:3]) + list(group_axes), titles):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(budgets))], [f"N={b}" for b in budgets])
        ax.set_title(title)
    axes[1].axhline(1.0, color="k", lw=0.8)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 8), fontsize=8)
    fig.suptitle(f"SmolLM2-135M {doc['dtype']}, {doc['num_prompts']} Spec-Bench prompts x {doc['max_new_tokens']} "
                 f"tokens, batch 1, {doc['device']}, load avg {doc['load_avg_start'][0]}")
    fig.tight_layout(rect=(0, 0.08 if not groups else 0.05, 1, 1))
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
