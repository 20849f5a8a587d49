"""Test support shared by the test modules: tiny random Llamas with sharpened attention,
Spec-Bench prompts, scripted drafters that make tree shapes deterministic, and the chi-square
goodness-of-fit check of the sampling tests.

(Kept out of conftest.py: ``tests/kernels`` has a conftest of its own, so ``from conftest import``
would be ambiguous.)"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Sequence

import pytest
import torch

from dyntree.common.drafter import DraftRequest, Drafter
from dyntree.common.tree import DraftTree

SHARED = Path(os.environ.get("DYNTREE_SHARED", Path(__file__).resolve().parents[2] / "shared"))
SPEC_BENCH = SHARED / "data" / "spec_bench" / "question.jsonl"

torch.set_num_threads(min(2, os.cpu_count() or 1))


def spec_bench(n: int, offset: int = 0, stride: int = 1) -> list[dict]:
    """Spec-Bench questions from ``../shared`` (or ``$DYNTREE_SHARED``). Missing, a test skips on a
    developer's machine and fails under CI (``CI`` set), where a missing input must not pass."""
    if not SPEC_BENCH.exists():
        why = (f"Spec-Bench questions not found at {SPEC_BENCH}: this test needs ../shared beside the "
               "clone, or DYNTREE_SHARED pointing at a copy of it")
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    rows = [json.loads(line) for line in SPEC_BENCH.open()]
    return rows[offset::stride][:n]


def tiny_llama(seed: int = 0, vocab: int = 49152, qk_scale: float = 8.0, layers: int = 2):
    """A random 2-layer Llama whose q/k projections are scaled up: random-init attention is
    nearly uniform, which would hide mask and position bugs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      rope_theta=100.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(qk_scale)
            layer.self_attn.k_proj.weight.mul_(qk_scale)
    model.config._attn_implementation = "sdpa"
    return model


class OracleDrafter(Drafter):
    """Drafts from a known continuation: the true next tokens as a chain, optionally behind
    ``decoys`` wrong sibling branches placed first, so the accepted path is never the tree's
    first nodes (exercises mask, positions and KV compaction)."""

    name = "oracle"

    def __init__(self, references: dict[Any, Sequence[int]], prompt_lens: dict[Any, int], decoys: int = 0,
                 vocab: int = 49152) -> None:
        self.refs, self.prompt_lens, self.decoys, self.vocab = references, prompt_lens, decoys, vocab

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        trees = []
        for r in requests:
            done = len(r.token_ids) - self.prompt_lens[r.request_id]
            truth = list(self.refs[r.request_id][done : done + r.max_depth])
            tokens, parents = [r.root], [-1]
            if truth:
                for d in range(min(self.decoys, max(0, r.max_nodes - len(truth)) // 2) if r.max_depth > 1 else 0):
                    wrong = (truth[0] + 7 + 13 * d) % self.vocab
                    tokens += [wrong, (wrong + 1) % self.vocab]
                    parents += [0, len(tokens) - 2]
                prev = 0
                for t in truth[: r.max_nodes - (len(tokens) - 1)]:
                    tokens.append(t)
                    parents.append(prev)
                    prev = len(tokens) - 1
            trees.append(DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.ones(len(tokens))))
        return trees


def synthetic_head_cache(path: Path, vocab: int, hidden_size: int, lens: Sequence[int], seed: int = 0,
                         prompt_lens: Sequence[int] | None = None):
    """A Hydra training cache (see ``dyntree.training.data``) whose hidden state at token ``i`` is a
    fixed vector of token ``i`` plus noise: head k's teacher is then a function of ``x_{g+k}``,
    which sequential heads can learn. ``prompt_lens``: prompt tokens at the start of each sequence
    (default: a cache without ``prompt_lens.npy``, i.e. only the last prompt token)."""
    import numpy as np

    from dyntree.training.data import HiddenCache

    rng = np.random.default_rng(seed)
    proto = rng.normal(0, 3, (vocab, hidden_size))
    tokens = rng.integers(0, 60, sum(lens)).astype(np.int32)
    hidden = (proto[tokens] + rng.normal(0, 0.1, (sum(lens), hidden_size))).astype(np.float16)
    path.mkdir(parents=True)
    np.save(path / "tokens.npy", tokens)
    np.save(path / "hidden.npy", hidden)
    np.save(path / "offsets.npy", np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
    if prompt_lens is not None:
        np.save(path / "prompt_lens.npy", np.asarray(prompt_lens, dtype=np.int64))
    (path / "meta.json").write_text(json.dumps({"hidden_size": hidden_size, "sequences": len(lens), "tokens": sum(lens)}))
    return HiddenCache(path)


def chi2_pvalue_ok(counts: torch.Tensor, probs: torch.Tensor, alpha: float = 1e-3) -> tuple[bool, float, float]:
    """Chi-square goodness of fit (bins with expected count < 5 pooled) against ``probs``.

    Returns ``(passes, statistic, critical value)``; the critical value of chi2(df) at ``1 - alpha``
    uses the Wilson-Hilferty approximation (z = 3.09 for alpha = 1e-3)."""
    n = float(counts.sum())
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts.double()[big], counts.double()[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = obs.numel() - 1
    z = {1e-3: 3.090}[alpha]
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < crit, stat, crit
