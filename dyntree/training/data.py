"""Self-distillation data for draft heads: the target answers training prompts, we cache its tokens
and last-layer hidden states on disk.

The cache directory holds, per finished batch, ``chunks/NNNNN.npz`` (so an interrupted run resumes
at the next batch), and once all batches are done the consolidated arrays the trainer reads:

* ``tokens.npy``  int32 ``[M]``: per sequence, the last prompt token then the response tokens
  (through the end-of-sequence token when one was produced);
* ``hidden.npy``  fp16 (memory-mapped) ``[M, d]``: row ``i`` is the target's last-layer hidden state (after
  the final norm) at token ``i``: the state whose logits produced token ``i + 1``; the last row of
  each sequence is zero (never produced anything);
* ``offsets.npy`` int64 ``[S + 1]``: sequence boundaries;
* ``meta.json``: hidden size, counts, the generation settings.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from tqdm import tqdm

__all__ = ["HiddenCache", "read_prompts", "generate_cache"]


def read_prompts(files: Sequence[str | Path], limit: int, seed: int) -> list[str]:
    """Up to ``limit`` prompts (field ``prompt``) drawn without replacement, seeded, from jsonl files."""
    prompts: list[str] = []
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise FileNotFoundError(f"--data {path} does not exist")
        with path.open() as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                rec = json.loads(line)
                if not isinstance(rec.get("prompt"), str) or not rec["prompt"].strip():
                    raise ValueError(f"{path}:{lineno}: record has no non-empty string field 'prompt'")
                prompts.append(rec["prompt"])
    if not prompts:
        raise ValueError(f"no prompts in {', '.join(map(str, files))}")
    random.Random(seed).shuffle(prompts)
    return prompts[:limit]


def _encode(tokenizer: Any, prompt: str) -> list[int]:
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    ids = enc["input_ids"] if not isinstance(enc, list) else enc
    return [int(t) for t in ids]


@torch.no_grad()
def _generate_batch(
    model: Any, batch: list[list[int]], max_new_tokens: int, eos_id: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Greedy-generate for a left-padded batch; return (tokens, hidden, lengths) for its sequences."""
    device = next(model.parameters()).device
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    captured: list[torch.Tensor] = []
    norm = model.get_decoder().norm  # the LM-head input is the final norm's output
    handle = norm.register_forward_hook(lambda _m, _i, out: captured.append(out[:, -1].float().cpu()))
    try:
        seqs = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=pad_id, eos_token_id=eos_id,
        ).cpu()
    finally:
        handle.remove()
    hidden = torch.stack(captured, dim=1)  # [B, steps, d]; step s produced response token s
    toks_out, hid_out, lens = [], [], []
    for i in range(len(batch)):
        resp = seqs[i, width:].tolist()
        m = resp.index(eos_id) + 1 if eos_id in resp else len(resp)
        m = min(m, hidden.shape[1])
        if m < 2:
            continue
        toks_out.append(np.array([batch[i][-1], *resp[:m]], dtype=np.int32))
        h = np.zeros((m + 1, hidden.shape[2]), dtype=np.float16)
        h[:m] = hidden[i, :m].numpy().astype(np.float16)
        hid_out.append(h)
        lens.append(m + 1)
    d = hidden.shape[2]
    if not lens:
        return np.zeros(0, np.int32), np.zeros((0, d), np.float16), np.zeros(0, np.int64)
    return np.concatenate(toks_out), np.concatenate(hid_out), np.array(lens, dtype=np.int64)


def generate_cache(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    cache_dir: str | Path,
    batch_size: int = 16,
    max_new_tokens: int = 128,
    max_prompt_tokens: int = 256,
) -> "HiddenCache":
    """Generate responses and hidden states for ``prompts`` into ``cache_dir`` (resumable)."""
    out = Path(cache_dir)
    chunks = out / "chunks"
    chunks.mkdir(parents=True, exist_ok=True)
    settings = {"prompts": len(prompts), "batch_size": batch_size, "max_new_tokens": max_new_tokens,
                "max_prompt_tokens": max_prompt_tokens}
    if (out / "meta.json").exists():
        meta = json.loads((out / "meta.json").read_text())
        if meta["settings"] == settings:
            return HiddenCache(out)
        raise ValueError(f"{out} holds a cache made with other settings {meta['settings']}; use another --cache-dir")
    settings_file = out / "settings.json"
    if settings_file.exists() and json.loads(settings_file.read_text()) != settings:
        raise ValueError(f"{out} holds partial chunks made with other settings; use another --cache-dir")
    settings_file.write_text(json.dumps(settings))
    encoded = [e for e in (_encode(tokenizer, p) for p in prompts) if len(e) <= max_prompt_tokens]
    encoded.sort(key=len)  # similar lengths per batch: little padding
    eos = int(tokenizer.eos_token_id)
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)
    batches = [encoded[i:i + batch_size] for i in range(0, len(encoded), batch_size)]
    for b, batch in enumerate(tqdm(batches, desc="generate", unit="batch")):
        path = chunks / f"{b:05d}.npz"
        if path.exists():
            continue
        toks, hid, lens = _generate_batch(model, batch, max_new_tokens, eos, pad)
        tmp = chunks / f"{b:05d}.tmp.npz"
        np.savez(tmp, tokens=toks, hidden=hid, lengths=lens)
        tmp.rename(path)
    return _consolidate(out, len(batches), settings)


def _consolidate(out: Path, n_chunks: int, settings: dict[str, Any]) -> "HiddenCache":
    parts = [np.load(out / "chunks" / f"{b:05d}.npz") for b in range(n_chunks)]
    lengths = np.concatenate([p["lengths"] for p in parts])
    total = int(lengths.sum())
    d = int(next(p["hidden"].shape[1] for p in parts))
    hidden = np.lib.format.open_memmap(out / "hidden.npy", mode="w+", dtype=np.float16, shape=(total, d))
    tokens = np.empty(total, dtype=np.int32)
    pos = 0
    for p in parts:
        n = p["tokens"].shape[0]
        tokens[pos:pos + n] = p["tokens"]
        hidden[pos:pos + n] = p["hidden"]
        pos += n
    hidden.flush()
    del hidden
    np.save(out / "tokens.npy", tokens)
    np.save(out / "offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    meta = {"hidden_size": d, "sequences": int(lengths.size), "tokens": total, "settings": settings}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    return HiddenCache(out)


@dataclass
class HiddenCache:
    """Read access to a consolidated cache directory (arrays are memory-mapped)."""

    path: Path

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        if not (self.path / "meta.json").exists():
            raise FileNotFoundError(f"{self.path} holds no finished hidden-state cache (meta.json missing)")
        self.meta = json.loads((self.path / "meta.json").read_text())
        self.tokens = np.load(self.path / "tokens.npy")
        self.offsets = np.load(self.path / "offsets.npy")
        self.hidden = np.load(self.path / "hidden.npy", mmap_mode="r")

    @property
    def hidden_size(self) -> int:
        return int(self.meta["hidden_size"])

    def token_counts(self, vocab_size: int) -> np.ndarray:
        """How often each token occurs in the cached sequences (``[vocab_size]`` int64)."""
        return np.bincount(self.tokens, minlength=vocab_size).astype(np.int64)

    def positions(self, num_heads: int) -> tuple[np.ndarray, np.ndarray]:
        """Training positions ``g`` and how many heads have a target there (1..K).

        At ``g`` head ``k`` reads ``hidden[g]`` and tokens ``g+1..g+k`` and learns from the
        target's distribution at ``hidden[g+k]``; it needs ``g + k <= end - 2`` (``end`` = the
        sequence's exclusive end: the last row's hidden state produced nothing).
        """
        starts, ends = self.offsets[:-1], self.offsets[1:]
        pos, valid = [], []
        for s, e in zip(starts, ends):
            g = np.arange(s, e - 2)
            pos.append(g)
            valid.append(np.minimum(num_heads, e - 2 - g))
        return np.concatenate(pos), np.concatenate(valid).astype(np.int64)
