"""Prompt-lookup drafting over an n-gram index of the prompt and the generated text.

No training, no second model: the request's own tokens are the draft source. For the current
suffix (the last ``n`` committed tokens, longest ``n`` first) every earlier occurrence proposes
the tokens that followed it. The continuations are merged into a token trie, so different
continuations become sibling branches of one tree; a node's draft probability is the share of
continuations (weighted by match length) that pass through it. The tree keeps the
``max_nodes`` nodes with the highest path probability.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from dyntree.common.drafter import DraftRequest, Drafter, register_drafter
from dyntree.common.tree import DraftTree

__all__ = ["NgramOptions", "NgramDrafter"]


class NgramOptions(BaseModel):
    """Options of the n-gram drafter (``--drafter ngram[:min_n=1,max_n=4,max_matches=8]``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_n: int = Field(1, ge=1, description="shortest suffix that may match")
    max_n: int = Field(4, ge=1, description="longest suffix tried first")
    max_matches: int = Field(8, ge=1, description="most continuations merged into the tree")

    @model_validator(mode="after")
    def _order(self) -> "NgramOptions":
        if self.min_n > self.max_n:
            raise ValueError(f"min_n ({self.min_n}) must not exceed max_n ({self.max_n})")
        return self


@dataclass
class _Index:
    """Per-request n-gram index: ngram -> start positions of the tokens that followed it."""

    tokens: list[int] = field(default_factory=list)
    follow: dict[tuple[int, ...], list[int]] = field(default_factory=lambda: defaultdict(list))

    def extend(self, token_ids: Sequence[int], min_n: int, max_n: int) -> None:
        known = len(self.tokens)
        if len(token_ids) < known or (known and int(token_ids[known - 1]) != self.tokens[-1]):
            self.tokens, self.follow = [], defaultdict(list)  # history rewritten: rebuild
        start = len(self.tokens)
        self.tokens.extend(int(t) for t in token_ids[start:])
        for c in range(max(start, 1), len(self.tokens) + 1):  # continuation start c
            for n in range(min_n, min(max_n, c) + 1):
                self.follow[tuple(self.tokens[c - n : c])].append(c)


class NgramDrafter(Drafter):
    """Prompt lookup with several continuations merged into a tree."""

    name = "ngram"

    def __init__(self, options: NgramOptions | None = None) -> None:
        self.options = options or NgramOptions()
        self._index: dict[Hashable, _Index] = {}

    def propose(self, requests: Sequence[DraftRequest], target_kv: Any = None) -> list[DraftTree]:
        return [self._propose_one(r) for r in requests]

    def release(self, request_id: Hashable) -> None:
        self._index.pop(request_id, None)

    def _propose_one(self, req: DraftRequest) -> DraftTree:
        opt = self.options
        index = self._index.setdefault(req.request_id, _Index())
        index.extend(req.token_ids, opt.min_n, opt.max_n)
        toks, length = index.tokens, len(index.tokens)
        if req.max_nodes <= 0 or req.max_depth <= 0:
            return DraftTree.root_only(req.root)
        # gather continuations, longest suffix match first, most recent occurrence first
        seen: set[int] = set()
        conts: list[tuple[float, list[int]]] = []
        for n in range(min(opt.max_n, length), opt.min_n - 1, -1):
            for c in reversed(index.follow.get(tuple(toks[length - n :]), ())):
                if c >= length or c in seen:
                    continue
                seen.add(c)
                conts.append((float(n), toks[c : c + req.max_depth]))
                if len(conts) >= opt.max_matches:
                    break
            if len(conts) >= opt.max_matches:
                break
        return _trie_tree(req.root, conts, req.max_nodes)


def _trie_tree(root: int, conts: list[tuple[float, list[int]]], max_nodes: int) -> DraftTree:
    """Merge weighted continuations into a trie and keep the best ``max_nodes`` nodes."""
    # trie nodes: (parent, token, weight, depth); node 0 is the root
    parent, token, weight, depth = [-1], [root], [0.0], [0]
    children: dict[tuple[int, int], int] = {}
    for w, seq in conts:
        node = 0
        weight[0] += w
        for t in seq:
            key = (node, t)
            if key not in children:
                children[key] = len(token)
                parent.append(node)
                token.append(t)
                weight.append(0.0)
                depth.append(depth[node] + 1)
            node = children[key]
            weight[node] += w
    if len(token) == 1:
        return DraftTree.root_only(root)
    prob = [1.0] + [weight[i] / weight[parent[i]] for i in range(1, len(token))]
    path = [1.0] * len(token)
    for i in range(1, len(token)):  # trie nodes are created after their parents
        path[i] = path[parent[i]] * prob[i]
    # best path probability first; a child never beats its parent, ties keep parents first
    keep = sorted(range(1, len(token)), key=lambda i: (-path[i], depth[i], i))[:max_nodes]
    order = [0] + sorted(keep, key=lambda i: (depth[i], i))
    new = {old: k for k, old in enumerate(order)}
    return DraftTree(
        torch.tensor([token[i] for i in order], dtype=torch.int64),
        torch.tensor([-1] + [new[parent[i]] for i in order[1:]], dtype=torch.int64),
        torch.tensor([prob[i] for i in order], dtype=torch.float32),
    )


def _parse_options(options: str | None) -> NgramOptions:
    if not options:
        return NgramOptions()
    fields: dict[str, str] = {}
    for part in options.split(","):
        key, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"ngram option {part!r} must look like key=value (min_n, max_n, max_matches)")
        fields[key.strip()] = value.strip()
    return NgramOptions(**fields)


@register_drafter("ngram")
def _make_ngram(options: str | None = None, **_: Any) -> NgramDrafter:
    return NgramDrafter(_parse_options(options))
