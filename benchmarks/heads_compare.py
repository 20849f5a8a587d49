"""Compare Hydra checkpoints on held-out Spec-Bench prompts without decoding with each of them.

For each checkpoint: its training record (steps, data, held-out loss / top-1 on training-split
sequences, from ``config.json``) and, on Spec-Bench prompts the heads never saw (16 MT-Bench
prompts spread over its categories except coding, the first 10 coding prompts; chat template;
the target's own greedy continuation of ``--new-tokens``, computed once):

* per-head top-1 / top-5 agreement with the target's next token, teacher-forced with the
  target's own tokens (head ``k`` at output position ``t`` reads ``h_t`` and ``x_{t+1..t+k}``);
* ``chain_tau``: 1 + the mean number of leading heads whose top-1 is right at each position, i.e.
  the tokens per step greedy decoding would get with a top-1 chain as deep as the heads (exact
  for a chain: teacher forcing on the target's tokens is what verification checks).

Cheap (one target forward per prompt, then batched head calls): it ranks training choices
before the full tree evaluation (``modes_eval.py``) is worth running. Run:
``python benchmarks/heads_compare.py --heads DIR [DIR ...] --out FILE``.
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from dyntree.common.config import SamplingParams, SpecConfig
from dyntree.common.hydra import HydraHeads, TargetIdentity
from dyntree.common.hydra_checkpoint import load_heads
from dyntree.models import load_model, machine_kind
from dyntree.standalone.bench import Prompt, encode_prompt, load_prompts
from dyntree.standalone.engine import SpecEngine
from dyntree.standalone.target import hf_target, make_hf_drafter
from results_index import result_path  # benchmarks/ is on sys.path when run as a script

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "extraction", "stem", "humanities"}


def eval_sets(path: Path, mt_bench: int, coding: int) -> dict[str, list[Prompt]]:
    rows = load_prompts(path)
    mt = [p for p in rows if p.category in MT_BENCH]
    code = [p for p in rows if p.category == "coding"]
    return {"mt_bench": mt[:: max(1, len(mt) // mt_bench)][:mt_bench], "coding": code[:coding]}


@torch.no_grad()
def score(heads: HydraHeads, seqs: list[tuple[int, torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """Agreement and chain tau over ``(prompt_len, token ids, last hidden states)`` sequences.
    Heads with a prefix layer read its outputs, run causally over the whole sequence (prompt
    included, absolute positions), as the drafter feeds them when decoding."""
    k_max = heads.num_heads
    hit1, hit5, n = torch.zeros(k_max), torch.zeros(k_max), torch.zeros(k_max)
    chain = []
    for plen, ids, hidden in seqs:
        if heads.prefix is not None:
            hidden = heads.prefix_forward(hidden[None], torch.arange(len(ids))[None])[0][0]
        ts = torch.arange(plen - 1, len(ids) - 2)  # the state that produced output token t+1
        right = torch.ones(len(ts), dtype=torch.bool)
        depth = torch.zeros(len(ts))
        for k in range(1, k_max + 1):
            has = ts + k + 1 < len(ids)
            t = ts[has]
            path = torch.stack([ids[t + 1 + j] for j in range(k)], dim=1)
            top = heads.to_full_ids(heads.head_logits(k, hidden[t], path).topk(5, dim=-1).indices)
            want = ids[t + k + 1]
            hit1[k - 1] += (top[:, 0] == want).sum()
            hit5[k - 1] += (top == want[:, None]).any(1).sum()
            n[k - 1] += len(t)
            ok = torch.zeros(len(ts), dtype=torch.bool)
            ok[has] = top[:, 0] == want
            right &= ok
            depth += right.float()
        chain.append(depth)
    return {"positions": n.int().tolist(), "top1": [round(x, 4) for x in (hit1 / n).tolist()],
            "top5": [round(x, 4) for x in (hit5 / n).tolist()], "chain_tau": round(1 + torch.cat(chain).mean().item(), 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", nargs="+", required=True, help="Hydra checkpoint directories")
    ap.add_argument("--prompts", default=str(SPEC_BENCH))
    ap.add_argument("--mt-bench", type=int, default=16, help="MT-Bench prompts (spread over its categories)")
    ap.add_argument("--coding", type=int, default=10, help="coding prompts (the first N)")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=str(result_path("heads_compare", machine_kind(), "fp32")))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2", torch.float32)
    sets = eval_sets(Path(args.prompts), args.mt_bench, args.coding)
    engine = SpecEngine(model, tok, make_hf_drafter("none", model, tok), SpecConfig(drafter="none"))
    params = SamplingParams(max_new_tokens=args.new_tokens)
    seqs: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    with torch.inference_mode():
        for name, prompts in sets.items():
            seqs[name] = []
            for p in prompts:
                prompt = encode_prompt(tok, p.text, chat=True)
                out = engine.generate([prompt], params, request_ids=[p.id])[0].token_ids
                ids = torch.tensor(prompt + out)
                hidden = model(ids[None], output_hidden_states=True).hidden_states[-1][0].float()
                seqs[name].append((len(prompt), ids, hidden))
    target = hf_target(model, tok, "smollm2")
    ident = TargetIdentity.of(target)
    results = []
    for path in args.heads:
        heads = load_heads(path, ident, target.embed, target.lm_head)
        cfg = json.loads((Path(path) / "config.json").read_text())
        training = cfg.get("training", {})
        row = {"heads": path, "num_layers": cfg["num_layers"], "layer_width": cfg.get("layer_width", 1),
               "prefix_attention": cfg.get("prefix_attention", False),
               "training": {k: training.get(k) for k in ("command", "steps", "batch_size", "lr", "tokens",
                                                         "prompt_positions")}
                           | {"loss": training.get("loss", "soft")},
               "held_out_training_split": training.get("val"),
               **{name: score(heads, s) for name, s in seqs.items()}}
        results.append(row)
        print(json.dumps({k: row[k] for k in ("heads", "mt_bench", "coding")}), flush=True)
    doc = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "device": f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
           "model": "SmolLM2-135M-Instruct", "dtype": "fp32", "new_tokens": args.new_tokens,
           "prompt_ids": {name: [p.id for p in ps] for name, ps in sets.items()}, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
