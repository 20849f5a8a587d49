"""Self-distillation data for draft heads: the target answers training prompts, we cache its tokens
and last-layer hidden states on disk.

The cache directory holds, per finished batch, ``chunks/NNNNN.npz`` (so an interrupted run resumes
at the next batch), and once all batches are done the consolidated arrays the trainer reads:

* ``tokens.npy``  int32 ``[M]``: per sequence, the prompt tokens then the response tokens
  (through the end-of-sequence token when one was produced);
* ``hidden.npy``  fp16 (memory-mapped) ``[M, d]``: row ``i`` is the target's last-layer hidden state (after
  the final norm) at token ``i``: the state whose logits produced token ``i + 1``; the last row of
  each sequence is zero (never produced anything);
* ``offsets.npy`` int64 ``[S + 1]``: sequence boundaries;
* ``prompt_lens.npy`` int64 ``[S]``: prompt tokens at the start of each sequence. Heads train on the
  response part only (from the last prompt token on); the prompt rows are context for the prefix
  layer (Hydra++ sees the whole prompt at inference, so it trains with it). Caches written before
  this file existed hold only the last prompt token (a prompt length of 1);
* ``meta.json``: hidden size, counts, the generation settings.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from tqdm import tqdm

from dyntree.standalone.attention import GROUPED

__all__ = ["HiddenCache", "read_prompts", "encode_prompt", "generate_cache"]


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


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt as the target sees it: the chat template with the generation prompt, as token ids."""
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    ids = enc["input_ids"] if not isinstance(enc, list) else enc
    return [int(t) for t in ids]


@torch.no_grad()
def _generate_batch(
    model: Any, batch: list[list[int]], max_new_tokens: int, eos_id: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Greedy-generate for a left-padded batch; return (tokens, hidden, lengths, prompt lengths)
    for its sequences (prompt and response each)."""
    device = next(model.parameters()).device
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    captured: list[torch.Tensor] = []
    attention = model.config._attn_implementation
    model.set_attn_implementation(GROUPED)
    norm = model.get_decoder().norm  # the LM-head input is the final norm's output
    # the first call is the prefill (every prompt position), then one position per step
    handle = norm.register_forward_hook(lambda _m, _i, out: captured.append(out.float().cpu()))
    try:
        seqs = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=pad_id, eos_token_id=eos_id,
        ).cpu()
    finally:
        handle.remove()
        model.set_attn_implementation(attention)
    prefill = captured[0]  # [B, width, d]
    # [B, steps, d]: step s produced response token s (step 0 is the prefill's last position)
    hidden = torch.cat([prefill[:, -1:], *captured[1:]], dim=1)
    toks_out, hid_out, lens, plens = [], [], [], []
    for i, prompt in enumerate(batch):
        resp = seqs[i, width:].tolist()
        m = resp.index(eos_id) + 1 if eos_id in resp else len(resp)
        m = min(m, hidden.shape[1])
        if m < 2:
            continue
        p = len(prompt)
        toks_out.append(np.array([*prompt, *resp[:m]], dtype=np.int32))
        h = np.zeros((p + m, hidden.shape[2]), dtype=np.float16)
        h[:p - 1] = prefill[i, width - p:width - 1].numpy().astype(np.float16)
        h[p - 1:p - 1 + m] = hidden[i, :m].numpy().astype(np.float16)
        hid_out.append(h)
        lens.append(p + m)
        plens.append(p)
    d = hidden.shape[2]
    if not lens:
        return np.zeros(0, np.int32), np.zeros((0, d), np.float16), np.zeros(0, np.int64), np.zeros(0, np.int64)
    return (np.concatenate(toks_out), np.concatenate(hid_out), np.array(lens, dtype=np.int64),
            np.array(plens, dtype=np.int64))


def generate_cache(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    cache_dir: str | Path,
    batch_size: int = 16,
    max_new_tokens: int = 128,
    max_prompt_tokens: int = 256,
    time_budget_s: float | None = None,
    max_batches: int | None = None,
) -> "HiddenCache":
    """Generate responses and hidden states for ``prompts`` into ``cache_dir`` (resumable).

    Batches hold prompts of similar length (little padding) and run in a seeded random order, so
    the batches finished so far are an unbiased sample of the prompts. With ``time_budget_s`` the
    run starts no batch once the budget is spent (but always has at least one) and consolidates
    what is finished (``meta["complete"]`` is then False; a budget of 0 uses what an earlier run
    left); a later call with the same settings resumes. ``max_batches`` generates no batch past the
    first that many of the order, the same batches on any machine (a budget in time is not);
    batches an earlier call already made stay in the cache.
    """
    out = Path(cache_dir)
    chunks = out / "chunks"
    chunks.mkdir(parents=True, exist_ok=True)
    settings = {"prompts": len(prompts), "batch_size": batch_size, "max_new_tokens": max_new_tokens,
                "max_prompt_tokens": max_prompt_tokens, "prompt_hidden": True}
    consolidated = -1  # batches in the consolidated arrays, if any
    if (out / "meta.json").exists():
        meta = json.loads((out / "meta.json").read_text())
        if meta["settings"] != settings:
            raise ValueError(f"{out} holds a cache made with other settings {meta['settings']}; use another --cache-dir")
        if meta.get("complete", True):
            return HiddenCache(out)
        consolidated = meta["batches_done"]
    settings_file = out / "settings.json"
    if settings_file.exists() and json.loads(settings_file.read_text()) != settings:
        raise ValueError(f"{out} holds partial chunks made with other settings; use another --cache-dir")
    settings_file.write_text(json.dumps(settings))
    encoded = [e for e in (encode_prompt(tokenizer, p) for p in prompts) if len(e) <= max_prompt_tokens]
    encoded.sort(key=len)  # similar lengths per batch: little padding
    eos = int(tokenizer.eos_token_id)
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)
    batches = [encoded[i:i + batch_size] for i in range(0, len(encoded), batch_size)]
    order = np.random.default_rng(len(batches)).permutation(len(batches)).tolist()
    t0 = time.monotonic()
    have_one = any((chunks / f"{b:05d}.npz").exists() for b in order)
    bar = tqdm(order, desc="generate", unit="batch")
    for i, b in enumerate(bar):
        if max_batches is not None and i >= max_batches:
            bar.close()
            break
        path = chunks / f"{b:05d}.npz"
        if path.exists():
            continue
        if time_budget_s is not None and have_one and time.monotonic() - t0 > time_budget_s:
            bar.close()
            break
        have_one = True
        toks, hid, lens, plens = _generate_batch(model, batches[b], max_new_tokens, eos, pad)
        tmp = chunks / f"{b:05d}.tmp.npz"
        np.savez(tmp, tokens=toks, hidden=hid, lengths=lens, prompt_lens=plens)
        tmp.rename(path)
    done = [b for b in order if (chunks / f"{b:05d}.npz").exists()]
    if len(done) == consolidated:  # nothing new since the last consolidation: training jobs can share it
        return HiddenCache(out)
    return _consolidate(out, done, settings, complete=len(done) == len(batches))


def _consolidate(out: Path, done: list[int], settings: dict[str, Any], complete: bool) -> "HiddenCache":
    parts = [np.load(out / "chunks" / f"{b:05d}.npz") for b in done]
    lengths = np.concatenate([p["lengths"] for p in parts])
    prompt_lens = np.concatenate([p["prompt_lens"] for p in parts])
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
    np.save(out / "prompt_lens.npy", prompt_lens)
    meta = {"hidden_size": d, "sequences": int(lengths.size), "tokens": total,
            "response_tokens": int(total - prompt_lens.sum() + prompt_lens.size), "settings": settings,
            "complete": complete, "batches_done": len(done)}
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
        plens = self.path / "prompt_lens.npy"
        self.has_prompts = plens.exists()  # sequences start with the whole prompt
        self.prompt_lens = np.load(plens) if self.has_prompts else np.ones(self.offsets.size - 1, np.int64)
        self.hidden = np.load(self.path / "hidden.npy", mmap_mode="r")

    @property
    def hidden_size(self) -> int:
        return int(self.meta["hidden_size"])

    def token_counts(self, vocab_size: int) -> np.ndarray:
        """How often each token occurs in the cached sequences (``[vocab_size]`` int64)."""
        return np.bincount(self.tokens, minlength=vocab_size).astype(np.int64)

    @property
    def response_starts(self) -> np.ndarray:
        """Per sequence, the row of the last prompt token: the first training position."""
        return self.offsets[:-1] + self.prompt_lens - 1

    @property
    def template_len(self) -> int:
        """Rows every cached sequence starts with (the chat template's fixed header: the same tokens,
        so the same hidden states, in every sequence); 0 for a single sequence."""
        if self.offsets.size < 3:
            return 0
        starts, lens = self.offsets[:-1], np.diff(self.offsets)
        width = int(min(lens.min(), self.prompt_lens.min()))
        heads = self.tokens[starts[:, None] + np.arange(width)[None, :]]
        same = (heads == heads[:1]).all(0)
        return int(width if same.all() else np.argmin(same))

    def positions(self, num_heads: int, prompt: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Training positions ``g`` and how many heads have a target there (1..K).

        At ``g`` head ``k`` reads ``hidden[g]`` and tokens ``g+1..g+k`` and learns from the
        target's distribution at ``hidden[g+k]``; it needs ``g + k <= end - 2`` (``end`` = the
        sequence's exclusive end: the last row's hidden state produced nothing). Positions start at
        the last prompt token: the heads learn the target's own responses. With ``prompt`` they
        start after the shared template header (:attr:`template_len`) instead: the heads also learn
        the target's distribution over the prompt's (human-written) text, teacher-forced with the
        prompt's own tokens; caches without the prompt's hidden states are refused.
        """
        if prompt and not self.has_prompts:
            raise ValueError(f"{self.path} holds no prompt hidden states (cache written before they were kept)")
        starts = self.offsets[:-1] + np.minimum(self.template_len, self.prompt_lens - 1) if prompt else self.response_starts
        ends = self.offsets[1:]
        pos, valid = [], []
        for s, e in zip(starts, ends):
            g = np.arange(s, e - 2)
            pos.append(g)
            valid.append(np.minimum(num_heads, e - 2 - g))
        return np.concatenate(pos), np.concatenate(valid).astype(np.int64)
