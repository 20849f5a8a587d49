"""The core's draft trees in SGLang's verify layout, and its verdict back (torch only).

SGLang verifies ``N`` slots per request, flat ``[bs * N]`` (the worker picks ``N`` per step: the
widest tree, at most ``--speculative-num-draft-tokens``): request ``b``'s slot ``i`` is its tree's node ``i`` (root first, tree order) and its
KV goes to logical position ``seq_len[b] + i`` (SGLang's spec-v2 ``seq_lens`` exclude the verify
window). A tree smaller than ``N`` is padded with unlinked nodes (the root's token, the root's
position, attending to the prefix and themselves) that nothing can accept.

:func:`verify_layout` builds what SGLang's ``NgramVerifyInput`` carries: tokens, positions
(``seq_len + depth``), the tree mask in SGLang's FULL_MASK (GPU backends) or QLEN_ONLY (CPU)
layout, and the ``retrieve_*`` links of SGLang's tree kernels (first child = smallest index,
siblings ascending). :func:`commit_arrays` turns the speculator's
:class:`~dyntree.common.speculator.AcceptResult` into what SGLang's result processor reads: the
committed tokens ``[bs * stride]`` (``stride``: the flag's width) (row ``b`` holds its ``accept_lens[b]`` tokens first) and
``accept_lens`` (accepted drafts + bonus).

``ablate`` removes one piece of tree verification for the tests' controls (outputs must then
diverge): ``mask`` (causal attention over the slots), ``positions`` (slot index instead of depth).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal

import torch

from dyntree.common.speculator import AcceptResult
from dyntree.common.tree import DraftBatch, TreeBatch

__all__ = ["VerifyLayout", "verify_layout", "commit_arrays", "MaskMode"]

MaskMode = Literal["full", "qlen"]


@dataclass(frozen=True)
class VerifyLayout:
    """One decode step's trees, ``N`` slots per request (CPU tensors; the worker moves them)."""

    width: int  # N
    draft_token: torch.Tensor  # [bs * N] int64
    positions: torch.Tensor  # [bs * N] int64
    tree_mask: torch.Tensor  # [bs, N, N] bool: slot i sees slot j (prefix not included)
    retrieve_index: torch.Tensor  # [bs, N] int64: b * N + i
    retrieve_next_token: torch.Tensor  # [bs, N] int64: first child, -1 for none
    retrieve_next_sibling: torch.Tensor  # [bs, N] int64: next sibling, -1 for none
    valid_rows: torch.Tensor  # [num_nodes] int64: flat slot of each DraftBatch node, in its order

    def custom_mask(self, seq_lens: list[int], mode: MaskMode, device: torch.device | str = "cpu") -> torch.Tensor:
        """The flat bool mask SGLang's attention backends read, on ``device`` (only the small tree
        blocks are copied there; the prefix columns are made in place).

        ``full``: per request ``N`` rows of ``seq_len + N`` (prefix all True, then the tree block);
        ``qlen``: per request the ``N x N`` tree block only."""
        tree = self.tree_mask.to(device)
        if mode == "qlen":
            return tree.flatten()
        n = self.width
        return torch.cat([
            torch.cat([torch.ones(n, s, dtype=torch.bool, device=device), tree[b]], dim=1).flatten()
            for b, s in enumerate(seq_lens)
        ])  # fmt: skip


def verify_layout(batch: DraftBatch, seq_lens: list[int], width: int, ablate: Iterable[str] = ()) -> VerifyLayout:
    """Pad ``batch``'s trees to ``width`` slots each (see the module docstring)."""
    ablate = frozenset(ablate)
    bs, n = batch.batch_size, width
    padded = TreeBatch.from_trees(batch.trees, width=n)
    tokens, depth, mask = padded.tokens, padded.depths, padded.mask
    first_child = torch.full((bs, n), -1, dtype=torch.int64)
    next_sibling = torch.full((bs, n), -1, dtype=torch.int64)
    for b, parents in enumerate(padded.parents.tolist()):  # children ascending per parent
        last_child: dict[int, int] = {}
        for i, p in enumerate(parents[1:], start=1):
            if p < 0:  # padding
                continue
            if p in last_child:
                next_sibling[b, last_child[p]] = i
            else:
                first_child[b, p] = i
            last_child[p] = i
    if "mask" in ablate:
        mask = torch.tril(torch.ones(n, n, dtype=torch.bool)).repeat(bs, 1, 1)
    if "positions" in ablate:
        depth = torch.arange(n).repeat(bs, 1)
    starts = torch.tensor(seq_lens, dtype=torch.int64)[:, None]
    slot = torch.arange(n)[None, :]
    flat = torch.arange(bs)[:, None] * n + slot
    return VerifyLayout(
        width=n, draft_token=tokens.flatten(), positions=(starts + depth).flatten(), tree_mask=mask,
        retrieve_index=flat, retrieve_next_token=first_child, retrieve_next_sibling=next_sibling,
        valid_rows=flat[padded.valid],
    )  # fmt: skip


def commit_arrays(result: AcceptResult, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(accept_tokens [bs * N] int32, accept_lens [bs] int32)`` for SGLang's result processor."""
    bs = len(result.tokens)
    tokens = torch.zeros(bs, width, dtype=torch.int32)
    for b, toks in enumerate(result.tokens):
        tokens[b, : len(toks)] = torch.tensor(toks, dtype=torch.int32)
    lens = torch.tensor([len(t) for t in result.tokens], dtype=torch.int32)
    return tokens.flatten(), lens
