"""Probe: do EAGLE-3-style multi-layer target features help Hydra heads on SmolLM2?

Trains two sets of sequential Hydra heads with the same code, data, steps and seed, differing only
in what they read at position ``t``:

* ``last``: the target's final hidden state ``h_t`` (what the shipped heads read);
* ``multi``: ``h_t`` plus the residual streams after two earlier decoder layers (default: layers 10
  and 20 of 30), each RMS-normalised, concatenated (EAGLE-3 fuses low / mid / high features the
  same way before its draft layer).

Data: ``--sequences`` cached training sequences (prompt + the target's own response) of a
``train-heads`` cache, re-run through the target once to collect the intermediate states (the
cache keeps only the last one). Heads: input projection, ``--layers`` residual SiLU layers, the
target's LM head restricted to the shipped heads' reduced vocabulary; loss: cross-entropy against
the target's softmax at ``t + k`` (as ``train-heads``). Held-out sequences (``--val-fraction``)
are scored by top-1 / top-5 agreement with the target's next token and the teacher-forced chain
tau. This is a probe on a subset: it says whether the features are worth the engine support
(every adapter would have to hand the drafter three hidden states per token), not how good fully
trained heads would be. Run: ``python benchmarks/multilayer_probe.py --cache DIR --out FILE``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from tqdm import tqdm

from dyntree.common.drafters.hydra import SHIPPED_HEADS
from dyntree.models import load_model, machine_kind
from dyntree.training.data import HiddenCache
from results_index import result_path  # benchmarks/ is on sys.path when run as a script


class Heads(nn.Module):
    """K sequential heads over ``features`` input vectors of size d (plus the k path embeddings)."""

    def __init__(self, features: int, d: int, k_max: int, layers: int, embed: torch.Tensor, out: torch.Tensor):
        super().__init__()
        self.register_buffer("embed", embed)
        self.register_buffer("out", out)
        self.proj = nn.ModuleList(nn.Linear((features + k) * d, d, bias=False) for k in range(1, k_max + 1))
        self.layers = nn.ModuleList(nn.ModuleList(nn.Linear(d, d) for _ in range(layers)) for _ in range(k_max))
        with torch.no_grad():
            for p in self.proj:  # start as the target's own head on h_t (the last feature block)
                p.weight.zero_()
                p.weight[:, (features - 1) * d:features * d].copy_(torch.eye(d))
            for head in self.layers:
                for lin in head:
                    lin.weight.zero_()
                    lin.bias.zero_()

    def forward(self, x: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
        """``x`` [N, F*d], ``path`` [N, K] token ids -> logits [N, K, V']."""
        outs = []
        for k in range(1, len(self.proj) + 1):
            z = self.proj[k - 1](torch.cat([x, self.embed[path[:, :k]].flatten(1)], 1))
            for lin in self.layers[k - 1]:
                z = z + F.silu(lin(z))
            outs.append(z @ self.out.T)
        return torch.stack(outs, 1)


@torch.no_grad()
def collect(model, cache: HiddenCache, seqs: np.ndarray, layers: list[int], batch: int) -> torch.Tensor:
    """``[rows, F, d]`` fp16 for the sequences ``seqs`` back to back (in that order): per position,
    the RMS-normalised residual stream after each of ``layers``, then the final (normed) hidden
    state. Sequences run in batches of similar length (less padding)."""
    lens = (cache.offsets[seqs + 1] - cache.offsets[seqs]).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    d = model.config.hidden_size
    out = torch.zeros(int(lens.sum()), len(layers) + 1, d, dtype=torch.float16)
    order = np.argsort(lens, kind="stable")
    for i in tqdm(range(0, len(order), batch), desc="features", unit="batch"):
        chunk = order[i:i + batch]
        width = int(lens[chunk].max())
        ids = torch.zeros(len(chunk), width, dtype=torch.int64)
        att = torch.zeros_like(ids)
        for r, j in enumerate(chunk):
            s, n = seqs[j], int(lens[j])
            ids[r, :n] = torch.from_numpy(cache.tokens[cache.offsets[s]:cache.offsets[s + 1]].astype(np.int64))
            att[r, :n] = 1
        hs = model.model(input_ids=ids, attention_mask=att, output_hidden_states=True).hidden_states  # no LM head
        feats = torch.stack([hs[j] * torch.rsqrt(hs[j].pow(2).mean(-1, keepdim=True) + 1e-6) for j in layers]
                            + [hs[-1]], 2)  # [B, T, F, d]
        for r, j in enumerate(chunk):
            out[starts[j]:starts[j] + lens[j]] = feats[r, :lens[j]].half()
    return out


class Data:
    """Training / held-out positions over the collected rows, gathered in batches (as HeadData)."""

    def __init__(self, feats: torch.Tensor, cache: HiddenCache, seqs: np.ndarray, k_max: int, val: set[int]):
        self.feats, self.k_max = feats, k_max
        lens = (cache.offsets[seqs + 1] - cache.offsets[seqs]).astype(np.int64)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        self.tokens = torch.from_numpy(np.concatenate(
            [cache.tokens[cache.offsets[s]:cache.offsets[s + 1]] for s in seqs]).astype(np.int64))
        split: dict[bool, tuple[list, list]] = {False: ([], []), True: ([], [])}
        for j, s in enumerate(seqs):  # response rows g with a head target: g + 1 <= end - 2
            g = np.arange(starts[j] + cache.prompt_lens[s] - 1, starts[j] + lens[j] - 2)
            split[j in val][0].append(g)
            split[j in val][1].append(np.minimum(k_max, starts[j] + lens[j] - 2 - g))
        self.train = tuple(torch.from_numpy(np.concatenate(x)) for x in split[False])
        self.val = tuple(torch.from_numpy(np.concatenate(x)) for x in split[True])

    def batch(self, pos: torch.Tensor, valid: torch.Tensor, use: slice):
        k = torch.arange(1, self.k_max + 1)
        mask = k[None, :] <= valid[:, None]
        ahead = torch.where(mask, pos[:, None] + k[None, :], pos[:, None] + 1)
        return (self.feats[pos, use].flatten(1).float(), self.tokens[ahead], self.feats[ahead, -1].float(),
                self.tokens[torch.where(mask, ahead + 1, ahead)], mask)


def run(name: str, data: Data, use: slice, n_feat: int, args, embed, out, token_map) -> dict:
    torch.manual_seed(args.seed)
    heads = Heads(n_feat, embed.shape[1], args.heads, args.layers, embed, out)
    opt = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    train_pos, train_valid = data.train
    for step in tqdm(range(args.steps), desc=name, unit="step"):
        lr = args.lr * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, len(train_pos), (args.batch_size,), generator=torch.Generator().manual_seed(step))
        x, path, teacher, _, mask = data.batch(train_pos[idx], train_valid[idx], use)
        logits = heads(x, path)
        with torch.no_grad():
            soft = torch.softmax(teacher @ out.T, -1)
        ce = -(soft * torch.log_softmax(logits, -1)).sum(-1)
        loss = (ce * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    hit1, hit5, n = torch.zeros(args.heads), torch.zeros(args.heads), torch.zeros(args.heads)
    val_pos, val_valid = data.val
    with torch.no_grad():
        for i in range(0, len(val_pos), 1024):
            x, path, _, nxt, mask = data.batch(val_pos[i:i + 1024], val_valid[i:i + 1024], use)
            top = token_map[heads(x, path).topk(5, -1).indices]  # [N, K, 5] full ids
            hit1 += ((top[..., 0] == nxt) & mask).sum(0)
            hit5 += ((top == nxt[..., None]).any(-1) & mask).sum(0)
            n += mask.sum(0)
    return {"top1": [round(v, 4) for v in (hit1 / n).tolist()], "top5": [round(v, 4) for v in (hit5 / n).tolist()],
            "positions": n.int().tolist()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", required=True, help="a train-heads cache directory (with the prompts' states)")
    ap.add_argument("--sequences", type=int, default=2000)
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--layers-from", default="10,20", help="decoder layers whose output joins h_t")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2, help="residual layers per head")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--feature-batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=str(result_path("multilayer_probe", machine_kind())))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cache = HiddenCache(args.cache)
    if not cache.has_prompts:
        raise SystemExit(f"{args.cache} holds no prompt states: the features need whole sequences")
    model, _ = load_model("smollm2", torch.float32)
    layers = [int(v) for v in args.layers_from.split(",")]
    n_seq = cache.offsets.size - 1
    seqs = np.sort(np.random.default_rng(args.seed).permutation(n_seq)[:args.sequences])
    t0 = time.time()
    feats = collect(model, cache, seqs, layers, args.feature_batch)
    t_feat = time.time() - t0
    # recomputed vs cached h_t (the cache's last row of a sequence is empty: it produced nothing)
    n0 = int(cache.offsets[seqs[0] + 1] - cache.offsets[seqs[0]])
    cached_last = torch.from_numpy(np.asarray(cache.hidden[cache.offsets[seqs[0]]:cache.offsets[seqs[0]] + n0 - 1])).float()
    drift = ((feats[:n0 - 1, -1].float() - cached_last).norm(dim=-1) / cached_last.norm(dim=-1)).max().item()
    n_val = max(1, int(round(len(seqs) * args.val_fraction)))
    val_slots = set(np.random.default_rng(args.seed + 1).permutation(len(seqs))[:n_val].tolist())
    data = Data(feats, cache, seqs, args.heads, val_slots)
    from safetensors.torch import load_file

    token_map = load_file(str(Path(SHIPPED_HEADS) / "model.safetensors"))["token_map"].to(torch.int64)
    embed = model.get_input_embeddings().weight.detach().float()
    out = model.lm_head.weight.detach().float()[token_map]
    n_feat = len(layers) + 1
    results = {}
    for name, use, nf in (("last", slice(n_feat - 1, n_feat), 1), ("multi", slice(0, n_feat), n_feat)):
        t1 = time.time()
        results[name] = run(name, data, use, nf, args, embed, out, token_map)
        results[name]["train_s"] = round(time.time() - t1, 1)
        print(name, json.dumps(results[name]), flush=True)
    doc = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "device": f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)", "model": "SmolLM2-135M-Instruct",
           "cache": args.cache, "sequences": len(seqs), "val_sequences": n_val, "train_positions": len(data.train[0]),
           "val_positions": len(data.val[0]), "feature_layers": layers, "feature_s": round(t_feat, 1),
           "recomputed_vs_cached_h_max_rel_diff": round(drift, 5), "config": vars(args), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
