"""Several bracketed ``vllm_bench.py`` runs of the same dyntree code on the same machine, read as one.

At batch 8 and 16 the engines of one config run at speeds of their own for as long as they live
(``docs/vllm.md``), so one run reads each config over its few engines (``--fresh-engines``: one a
round) and a config's ratio moves by a few percent from run to run. Every call of every run is read
over the plain calls right before and after it in its own run (``vllm_bench.bracketed``); pooled,
the geometric mean and its bootstrap interval rest on every engine those runs built. Each run's own
reading is kept beside the pooled one.

    python benchmarks/vllm_runs.py RUN [RUN ...] [--out PATH]

A ``RUN`` is a result file, or ``REV:PATH`` for one in git history. Runs are pooled only when they
measured the same thing: machine, CPU, dtype, vLLM and torch, prompts, tokens, configs and
batches, and the same dyntree code, which a run names (``code``: the git tree of ``dyntree/``; a
run that does not is read from ``REV:PATH``, as the code at the commit that stored it); anything
else is refused, by field.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_bench import bracketed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: what two runs must share to be pooled
SAME = ("machine", "cpu", "dtype", "versions", "model", "max_tokens", "batches", "prompts", "speculative_configs")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def load(source: str) -> dict[str, Any]:
    """A run's JSON with ``source`` and ``code`` set (the code from git history where the run
    does not name it); refuses a run that is not bracketed or whose code is not known."""
    rev, sep, path = source.partition(":")
    from_git = bool(sep) and not Path(source).exists()
    try:
        doc = json.loads(_git("show", f"{rev}:{path}") if from_git else Path(source).read_text())
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"vllm_runs: cannot read {source}: {e}") from None
    if "calls" not in doc or "bracketed" not in doc:
        raise SystemExit(f"vllm_runs: {source} is not a bracketed run (vllm_bench.py --bracket)")
    if doc.get("code") is None:
        if not from_git:
            raise SystemExit(f"vllm_runs: {source} does not name the dyntree code it measured; pass it as REV:PATH")
        doc["code"] = {"dyntree_tree": _git("rev-parse", f"{rev}:dyntree").strip(), "modified": False,
                       "from": f"the commit {rev} that stored it"}
    if doc["code"].get("modified"):
        raise SystemExit(f"vllm_runs: {source} measured uncommitted dyntree code")
    doc["source"] = source
    return doc


def pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The pooled reading of ``runs`` (see the module docstring); raises ``ValueError`` naming the
    first field in which two runs differ."""
    first = runs[0]
    for run in runs[1:]:
        for key in SAME:
            if run.get(key) != first.get(key):
                raise ValueError(f"runs {first['source']} and {run['source']} differ in {key!r}: not pooled")
        if run["code"]["dyntree_tree"] != first["code"]["dyntree_tree"]:
            raise ValueError(f"runs {first['source']} and {run['source']} measured different dyntree code: not pooled")
    calls = [{**c, "round": (i, c["round"])} for i, run in enumerate(runs) for c in run["calls"]]
    pooled = bracketed(calls)
    return {
        **{key: first.get(key) for key in SAME}, "code": first["code"]["dyntree_tree"],
        "runs": [{"source": r["source"], "date": r["date"], "rounds": r["rounds"], "mode": r["mode"],
                  "bracketed": {c: {k: v[k] for k in ("ratio", "ci95", "calls")} for c, v in r["bracketed"].items()}}
                 for r in runs],
        "bracketed": pooled,
        "summary": {f"pooled bracketed: {c}": f"{v['ratio']:.3f}x [{v['ci95'][0]:.3f}, {v['ci95'][1]:.3f}] over the "
                                              f"plain calls around it ({v['calls']} calls, {len(runs)} runs)"
                    for c, v in pooled.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="result files, or REV:PATH in git history")
    ap.add_argument("--out", help="default: benchmarks/results/vllm_runs/<machine>_<dtype>_<batches>.json")
    args = ap.parse_args()
    if len(args.runs) < 2:
        ap.error("pool at least two runs")
    runs = [load(s) for s in args.runs]
    try:
        doc = pool(runs)
    except ValueError as e:
        ap.error(str(e))
    doc = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **doc}
    name = f"{doc['machine']}_{doc['dtype']}_" + "_".join(f"b{b}" for b in doc["batches"])
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / "vllm_runs" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    for config, line in doc["summary"].items():
        print(f"{config}: {line}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
