"""Self-distillation trainer for Hydra heads on a :class:`~dyntree.training.data.HiddenCache`.

Head ``k`` at cached position ``g`` reads ``hidden[g]`` and tokens ``g+1..g+k`` (teacher-forced on
the target's own greedy output) and is trained with cross-entropy against the target's softmax at
``hidden[g+k]`` through the same (full or reduced) output rows: pure teacher distillation, the
target frozen (``TrainConfig.loss``: ``soft``, the whole softmax, whose gradient is that of
KL(teacher || head); ``hard``, the teacher's top-1 token only; ``topK``, the teacher's K most likely
tokens, renormalised; with a reduced vocabulary the top tokens are taken among its rows).
Held-out loss is always the soft one. A batch is ``batch_size`` positions
drawn at random.

Heads with prefix attention read the prefix layer's output at ``g`` instead of ``hidden[g]``, so
they train on windows: a batch is ``max(1, batch_size // window)`` windows (the same position
slots per step as without the layer), each up to ``window`` consecutive rows of one cached
sequence (ending at a random training position ``g``, starting at ``max(sequence start,
g - window + 1)``); the prefix layer runs causally over each window and the head losses apply at
its response positions. Cached sequences start with the whole prompt (caches written since
``prompt_lens.npy`` exists), so windows near the start of a response reach back into the prompt,
as the layer does at inference. Held-out sequences are scored in steps of ``window // 2``
positions, each step in a window with up to ``window`` rows of context.

The run is seeded (batch ``s`` is drawn from a generator seeded by ``(seed, s)``), resumable
(``train_state.pt`` every ``save_every`` steps), logs per-head loss and top-1 accuracy (against
the target's actual next token, full vocabulary) to ``train_log.jsonl`` and a progress bar, and
evaluates on held-out sequences at the end.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from tqdm import tqdm

from dyntree.common.calibration import CONFIDENCE_EDGES, AcceptanceTable, bin_confidence
from dyntree.common.hydra import HydraConfig, HydraHeads, HydraMismatchError
from dyntree.common.hydra_checkpoint import check_target, read_config
from dyntree.training.data import HiddenCache

__all__ = ["TrainConfig", "loss_top_k", "HeadData", "train", "evaluate", "measure_acceptance", "reduced_token_map",
           "check_init", "checkpoint_token_map", "warm_start"]


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 3000
    batch_size: int = 256
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.0
    seed: int = 0
    save_every: int = 250
    log_every: int = 25
    val_fraction: float = 0.02
    window: int = 64  # positions per window (heads with a prefix layer)
    loss: str = "soft"  # soft | hard | topK: what of the teacher's softmax the heads learn
    autocast: str = "fp32"  # fp32 | bf16: the forward's matmuls under CPU/CUDA autocast (weights stay fp32)

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "window"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        loss_top_k(self.loss)
        if self.autocast not in ("fp32", "bf16"):
            raise ValueError(f"TrainConfig.autocast must be fp32 or bf16, got {self.autocast!r}")

    @property
    def windows_per_batch(self) -> int:
        """Windows per step for heads with a prefix layer: ``batch_size`` position slots."""
        return max(1, self.batch_size // self.window)


def loss_top_k(loss: str) -> int:
    """How many of the teacher's most likely tokens a ``loss`` name keeps: 0 = all (``soft``),
    1 (``hard``), K (``topK``, K >= 1); anything else is refused naming the accepted forms."""
    if loss == "soft":
        return 0
    if loss == "hard":
        return 1
    m = re.fullmatch(r"top([0-9]+)", loss)
    if m is None or int(m.group(1)) < 1:
        raise ValueError(f"loss must be soft, hard or topK with K >= 1 (e.g. top8), got {loss!r}")
    return int(m.group(1))


def _teacher(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The label distribution: the teacher's softmax, or its ``top_k`` most likely tokens renormalised."""
    if top_k == 0 or top_k >= logits.shape[-1]:
        return torch.softmax(logits, dim=-1)
    vals, idx = logits.topk(top_k, dim=-1)
    return torch.zeros_like(logits).scatter_(-1, idx, torch.softmax(vals, dim=-1))


def reduced_token_map(counts: np.ndarray, size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids (ties: lower id first), sorted by id."""
    if not 0 < size <= counts.size:
        raise ValueError(f"--vocab-size {size} must lie in [1, {counts.size}]")
    order = np.lexsort((np.arange(counts.size), -counts))[:size]
    return torch.from_numpy(np.sort(order)).to(torch.int64)


class HeadData:
    """The cache held in memory on ``device``, split by sequence into train and validation sets.

    ``train_pos`` / ``val_pos`` are the training positions (cache rows), ``*_valid`` how many heads
    have a target there, ``*_start`` / ``*_end`` the bounds (first row, exclusive end) of the
    cached sequence each position lies in, ``*_rstart`` the first response position of that
    sequence (its last prompt token). With ``prompt_positions`` the training positions also cover
    the prompts (after the shared template header: :meth:`HiddenCache.positions`); held-out
    sequences are scored on their responses either way. ``train_fraction`` < 1 trains on a seeded
    random share of the non-held-out sequences (data-scaling studies; the held-out set is unchanged).
    ``val_fraction`` 1 holds every sequence out (measuring trained heads on data they never saw).
    """

    def __init__(self, cache: HiddenCache, num_heads: int, val_fraction: float, seed: int, device: torch.device,
                 prompt_positions: bool = False, train_fraction: float = 1.0):
        if not 0 < train_fraction <= 1:
            raise ValueError(f"train_fraction must be in (0, 1], got {train_fraction}")
        self.num_heads = num_heads
        self.device = device
        self.hidden = torch.from_numpy(np.array(cache.hidden)).to(device)
        self.tokens = torch.from_numpy(cache.tokens.astype(np.int64)).to(device)
        n_seq = cache.offsets.size - 1
        # at least one held out; all of them at val_fraction 1 (measuring trained heads on unseen data)
        n_val = (n_seq if val_fraction >= 1
                 else max(1, int(round(n_seq * val_fraction))) if val_fraction > 0 and n_seq > 1 else 0)
        perm = np.random.default_rng(seed).permutation(n_seq)
        val_seqs = perm[:n_val]
        train_seqs = perm[n_val:n_val + max(1, int(round((n_seq - n_val) * train_fraction)))]
        as_t = lambda x: torch.from_numpy(np.ascontiguousarray(x)).to(device)  # noqa: E731

        def split(prompt: bool, held_out: bool) -> tuple[torch.Tensor, ...]:
            pos, valid = cache.positions(num_heads, prompt=prompt)
            seq_of = np.searchsorted(cache.offsets, pos, side="right") - 1
            keep = np.isin(seq_of, val_seqs if held_out else train_seqs)
            seq_of = seq_of[keep]
            return (as_t(pos[keep]), as_t(valid[keep]), as_t(cache.offsets[seq_of]), as_t(cache.offsets[seq_of + 1]),
                    as_t(cache.response_starts[seq_of]))

        # held-out sequences are always scored on their responses: comparable with and without prompts
        self.train_pos, self.train_valid, self.train_start, self.train_end, self.train_rstart = split(prompt_positions, False)
        self.val_pos, self.val_valid, self.val_start, self.val_end, self.val_rstart = split(False, True)
        if self.train_pos.numel() == 0 and val_fraction < 1:
            raise ValueError("the cache has no training positions (responses too short?)")

    def batch(self, pos: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        k = torch.arange(1, self.num_heads + 1, device=self.device)
        mask = k[None, :] <= valid[:, None]  # [B, K]: head k has a target here
        ahead = torch.where(mask, pos[:, None] + k[None, :], pos[:, None] + 1)  # clamp to a safe row
        return {
            "hidden": self.hidden[pos].float(),
            "tokens": self.tokens[ahead],  # x_{g+1..g+K}
            "teacher": self.hidden[ahead].float(),  # the state whose softmax is head k's label
            "next": self.tokens[torch.where(mask, ahead + 1, ahead)],  # the target's actual token
            "mask": mask,
        }

    def windows(
        self, first: torch.Tensor, last: torch.Tensor, end: torch.Tensor, score_from: torch.Tensor, window: int
    ) -> dict[str, torch.Tensor]:
        """A batch of windows: rows ``first[i] .. last[i]`` (at most ``window``) of a sequence ending
        (exclusively) at ``end[i]``, padded at the end; heads are scored at rows from
        ``score_from[i]`` on. ``hidden`` is ``[B, window, d]`` with ``positions`` ``[B, window]``
        (from 0 at ``first``: the prefix layer's RoPE is relative), the other fields as in
        :meth:`batch` for the ``B * window`` rows (context and padding rows: no head has a target)."""
        offsets = torch.arange(window, device=self.device)
        rows = first[:, None] + offsets
        real = (rows <= last[:, None]) & (rows >= score_from[:, None])
        rows = torch.minimum(rows, last[:, None])
        heads_there = torch.clamp(end[:, None] - 2 - rows, max=self.num_heads) * real
        b = self.batch(rows.flatten(), heads_there.flatten())
        b["hidden"] = b["hidden"].view(*rows.shape, -1)
        b["positions"] = offsets.expand(rows.shape)
        return b

    def train_windows(self, idx: torch.Tensor, window: int) -> dict[str, torch.Tensor]:
        """Windows ending at training positions ``idx`` (indices into ``train_pos``)."""
        last = self.train_pos[idx]
        first = torch.maximum(self.train_start[idx], last - window + 1)
        return self.windows(first, last, self.train_end[idx], self.train_rstart[idx], window)

    def val_windows(self, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The held-out positions in steps of ``max(1, window // 2)``, each scored once in a window
        of up to ``window`` rows ending at the step's last position: ``(first, last, end,
        score_from)`` rows."""
        step = max(1, window // 2)
        rel = self.val_pos - self.val_rstart
        ends_step = (rel % step == step - 1) | (self.val_pos == self.val_end - 3)  # or the sequence's last
        last, end = self.val_pos[ends_step], self.val_end[ends_step]
        score_from = self.val_rstart[ends_step] + (rel[ends_step] // step) * step
        first = torch.maximum(self.val_start[ends_step], last - window + 1)
        return first, last, end, score_from


def _losses(heads: HydraHeads, b: dict[str, torch.Tensor], top_k: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-head mean CE against the teacher's labels (:func:`_teacher` with ``top_k``), top-1 and
    top-5 accuracy (``[K]`` each) and the total loss. A batch of windows (``hidden`` ``[B, W, d]``)
    goes through the prefix layer first, causally per window."""
    hidden = b["hidden"]
    if hidden.dim() == 3:
        hidden = heads.prefix_forward(hidden, b["positions"])[0].flatten(0, 1)
    logits = heads(hidden, b["tokens"])  # [N, K, V']
    with torch.no_grad():
        teacher = _teacher(b["teacher"] @ heads.out_weight.T, top_k)
    ce = -(teacher * torch.log_softmax(logits, dim=-1)).sum(-1)  # [B, K]
    mask = b["mask"].float()
    per_head = (ce * mask).sum(0) / mask.sum(0).clamp(min=1)
    with torch.no_grad():
        top5 = heads.to_full_ids(logits.topk(5, dim=-1).indices)  # [B, K, 5]
        hit1 = (top5[..., 0] == b["next"]).float()
        hit5 = (top5 == b["next"][..., None]).any(-1).float()
        acc1 = (hit1 * mask).sum(0) / mask.sum(0).clamp(min=1)
        acc5 = (hit5 * mask).sum(0) / mask.sum(0).clamp(min=1)
    total = (ce * mask).sum() / mask.sum().clamp(min=1)
    return per_head, acc1, acc5, total


def _val_batches(heads: HydraHeads, data: HeadData, batch_size: int, window: int) -> Iterator[dict[str, torch.Tensor]]:
    """The held-out data in batches: positions, or windows (about ``batch_size`` positions each)
    for heads with a prefix layer."""
    if heads.prefix is None:
        for i in range(0, data.val_pos.numel(), batch_size):
            yield data.batch(data.val_pos[i:i + batch_size], data.val_valid[i:i + batch_size])
        return
    first, last, end, score_from = data.val_windows(window)
    step = max(1, batch_size // window)
    for i in range(0, first.numel(), step):
        yield data.windows(first[i:i + step], last[i:i + step], end[i:i + step], score_from[i:i + step], window)


@torch.no_grad()
def evaluate(heads: HydraHeads, data: HeadData, batch_size: int = 512, window: int = 64) -> dict[str, list[float]]:
    """Per-head CE and top-1/top-5 accuracy on the held-out positions (windows of ``window``
    positions for heads with a prefix layer)."""
    if data.val_pos.numel() == 0:
        return {}
    heads.eval()
    sums = torch.zeros(3, heads.num_heads, dtype=torch.float64)
    counts = torch.zeros(heads.num_heads, dtype=torch.float64)
    for b in _val_batches(heads, data, batch_size, window):
        per_head, acc1, acc5, _ = _losses(heads, b)
        n = b["mask"].sum(0).double().cpu()
        sums += torch.stack([per_head, acc1, acc5]).double().cpu() * n
        counts += n
    heads.train()
    avg = sums / counts.clamp(min=1)
    return {"loss": avg[0].tolist(), "top1": avg[1].tolist(), "top5": avg[2].tolist()}


@torch.no_grad()
def measure_acceptance(heads: HydraHeads, data: HeadData, ranks: int = 16, batch_size: int = 512,
                       window: int | None = None, source: str = "held-out training sequences") -> AcceptanceTable:
    """The heads' :class:`AcceptanceTable` (bins :data:`CONFIDENCE_EDGES`) on the held-out
    sequences: at each position, head ``k`` (teacher-forced on the target's tokens, i.e. its parent
    path accepted) offers its top-``ranks`` candidates with their probabilities, exactly as it
    drafts; a candidate is accepted when it is the target's token. A prefix layer sees windows of
    up to ``window`` positions (default: the longest sequence, so every position sees its whole
    prefix, the prompt included, as in decoding)."""
    if data.val_pos.numel() == 0:
        raise ValueError("measuring acceptance needs held-out sequences (val_fraction > 0)")
    if window is None:
        window = int((data.val_end - data.val_start).max())
    heads.eval()
    confidence_bins = len(CONFIDENCE_EDGES) + 1
    shape = (heads.num_heads, ranks, confidence_bins)
    hits = torch.zeros(shape, dtype=torch.float64)
    counts = torch.zeros(shape, dtype=torch.float64)
    depth = torch.arange(heads.num_heads)[None, :, None]
    rank = torch.arange(ranks)[None, None, :]
    for b in _val_batches(heads, data, batch_size, window):
        hidden = b["hidden"]
        if hidden.dim() == 3:
            hidden = heads.prefix_forward(hidden, b["positions"])[0].flatten(0, 1)
        probs = torch.softmax(heads(hidden, b["tokens"]).float(), dim=-1)  # [N, K, V']
        top = probs.topk(min(ranks, probs.shape[-1]), dim=-1)
        ids = heads.to_full_ids(top.indices).cpu()
        conf = bin_confidence(top.values.float().cpu())
        hit = (ids == b["next"].cpu()[..., None]).double()
        live = b["mask"].cpu()[..., None].expand(conf.shape)
        r = rank[..., : conf.shape[-1]].expand(conf.shape)
        cell = ((depth.expand(conf.shape) * ranks + r) * confidence_bins + conf)[live]
        counts.view(-1).index_add_(0, cell, torch.ones(cell.numel(), dtype=torch.float64))
        hits.view(-1).index_add_(0, cell, hit[live])
    heads.train()
    n = int(counts[:, 0].sum())
    return AcceptanceTable.from_counts(hits, counts, f"{source}: {n} head positions", edges=CONFIDENCE_EDGES)


def check_init(src: HydraConfig, mine: HydraConfig, ckpt_dir: str | Path) -> None:
    """Refuse to start a run configured as ``mine`` from the checkpoint ``src`` (read from
    ``ckpt_dir``) when architectures or targets differ, naming what differs. A checkpoint without
    a prefix layer may seed a run with one."""
    for name in ("num_heads", "num_layers", "layer_width", "hidden_size", "independent", "reduced_vocab"):
        if getattr(src, name) != getattr(mine, name):
            raise HydraMismatchError(f"{ckpt_dir}: {name} is {getattr(src, name)}, this run's is {getattr(mine, name)}")
    check_target(src, mine.target)
    if src.prefix_attention and (not mine.prefix_attention or src.prefix_heads != mine.prefix_heads):
        raise HydraMismatchError(f"{ckpt_dir}: has a prefix layer with {src.prefix_heads} heads, this run "
                                 f"{'has ' + str(mine.prefix_heads) if mine.prefix_attention else 'none'}")


def checkpoint_token_map(ckpt_dir: str | Path) -> torch.Tensor | None:
    """The reduced vocabulary (token map) a checkpoint was trained with, or None (full LM head). A
    warm start keeps it, so trained heads can go on learning from newly generated data."""
    from safetensors import safe_open

    with safe_open(str(Path(ckpt_dir) / "model.safetensors"), framework="pt") as f:
        return f.get_tensor("token_map").to(torch.int64) if "token_map" in f.keys() else None


def warm_start(heads: HydraHeads, ckpt_dir: str | Path) -> list[str]:
    """Copy a trained checkpoint's weights into ``heads`` before training (fine-tuning; e.g. trained
    heads gain a prefix layer, which starts as the identity). Returns the parameters left at their
    initialisation (the prefix layer's when the checkpoint has none). Refuses a checkpoint of
    another architecture, target (:func:`check_init`) or token map, naming what differs."""
    from safetensors.torch import load_file

    check_init(read_config(ckpt_dir), heads.config, ckpt_dir)
    state = load_file(str(Path(ckpt_dir) / "model.safetensors"))
    if not torch.equal(state.get("token_map", torch.empty(0, dtype=torch.int64)), heads.token_map.cpu()):
        raise HydraMismatchError(f"{ckpt_dir}: its reduced vocabulary (token map) differs from this run's: warm "
                                 "starts need the data the checkpoint was trained on")
    missing, unexpected = heads.load_state_dict(state, strict=False)
    if unexpected or any(not k.startswith("prefix.") for k in missing):
        raise HydraMismatchError(f"{ckpt_dir}: weights do not match: missing {missing}, unexpected {unexpected}")
    return missing


def train(heads: HydraHeads, data: HeadData, cfg: TrainConfig, out_dir: str | Path) -> dict[str, object]:
    """Train ``heads`` in place; resume from ``out_dir/train_state.pt`` when present."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state_path, log_path = out / "train_state.pt", out / "train_log.jsonl"
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)

    def lr_at(step: int) -> float:
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))

    top_k = loss_top_k(cfg.loss)
    start = 0
    if state_path.exists():
        state = torch.load(state_path, map_location=data.device, weights_only=False)
        if asdict(TrainConfig()) | state["config"] != asdict(cfg):  # fields newer than the state: defaults
            raise ValueError(f"{state_path} was written with another training config; use another --out")
        heads.load_state_dict(state["heads"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
    heads.train()
    n_train = data.train_pos.numel()
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="train", unit="step")
    t0 = time.time()
    for step in bar:
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        if heads.prefix is None:
            idx = torch.randint(0, n_train, (cfg.batch_size,), generator=gen).to(data.device)
            b = data.batch(data.train_pos[idx], data.train_valid[idx])
        else:
            idx = torch.randint(0, n_train, (cfg.windows_per_batch,), generator=gen).to(data.device)
            b = data.train_windows(idx, cfg.window)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        with torch.autocast(data.device.type, dtype=torch.bfloat16, enabled=cfg.autocast == "bf16"):
            per_head, acc1, _, total = _losses(heads, b, top_k)
        per_head = per_head.detach()
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.steps:
            rec = {"step": done, "lr": lr_at(step), "loss": [round(float(x), 4) for x in per_head],
                   "top1": [round(float(x), 4) for x in acc1], "elapsed_s": round(time.time() - t0, 1)}
            with log_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            bar.set_postfix(loss="/".join(f"{x:.2f}" for x in rec["loss"]),
                            acc="/".join(f"{x:.2f}" for x in rec["top1"]))
        if done % cfg.save_every == 0 or done == cfg.steps:
            tmp = state_path.with_suffix(".tmp")
            torch.save({"config": asdict(cfg), "heads": heads.state_dict(), "optimizer": opt.state_dict(),
                        "step": done}, tmp)
            tmp.replace(state_path)
    result = {"steps": cfg.steps, "val": evaluate(heads, data, window=cfg.window)}
    with log_path.open("a") as f:
        f.write(json.dumps({"final": result}) + "\n")
    return result
