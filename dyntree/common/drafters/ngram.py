"""Prompt-lookup drafting over an n-gram index of the prompt and the generated text.

No training, no second model: the request's own tokens are the draft source. For the current
suffix (the last ``n`` committed tokens, longest ``n`` first) every earlier occurrence proposes
the tokens that followed it, weighted by its match length: how far back it agrees with the
context (found through an ``n <= max_n`` key, then extended back up to ``MAX_MATCH`` tokens), so a
passage being copied outweighs a stray short match. The continuations are merged into a token trie,
so different continuations become sibling branches of one tree; a node's draft probability is the
(match-length weighted) share of continuations that pass through it. The tree keeps the
``max_nodes`` nodes with the highest path probability.

For the tree builder (``chain`` / ``static`` / ``dyntree`` / ``beam`` modes) the same index gives a
draft distribution after any path: committed tokens plus the path's drafted tokens form the
context whose suffix is looked up, so a source that kept matching the drafted tokens keeps its
growing weight. It is sparse by nature (a handful of continuations), so the candidates come
straight from the counts: no vocabulary-sized tensor is ever made. A row's shares are scaled by
``L / (L + 1)`` for its longest match ``L``: the chance that the text goes on as it did before
grows with the evidence, so a single continuation after a one-token match is not as sure as one
after a copied sentence (both have share 1). That is the confidence the dynamic tree's
calibration bins and corrects online; sampling renormalises a row, so its proposal is the shares.
Every candidate is offered to the dynamic tree (``candidates_per_node``): there are at most
``max_matches`` per node, and its values, not an entropy rule, decide which are worth a node.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
import math
from typing import TYPE_CHECKING, Hashable, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from dyntree.common.drafter import Candidates, DraftRequest, Drafter
from dyntree.common.sampling import process_logits
from dyntree.common.tree import DraftTree

if TYPE_CHECKING:
    from dyntree.common.builder import PartialTree
    from dyntree.common.config import SamplingParams

__all__ = ["NgramOptions", "NgramDrafter", "parse_ngram_options", "MAX_MATCH"]

#: longest match length counted when weighting a continuation (longer agreement adds no weight)
MAX_MATCH = 32


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
    evidence: int | None = None  # the longest match's class for these tokens, once asked

    def extend(self, token_ids: Sequence[int], min_n: int, max_n: int) -> None:
        known = len(self.tokens)
        if len(token_ids) < known or (known and int(token_ids[known - 1]) != self.tokens[-1]):
            self.tokens, self.follow = [], defaultdict(list)  # history rewritten: rebuild
        start = len(self.tokens)
        if start != len(token_ids):
            self.evidence = None
        self.tokens.extend(int(t) for t in token_ids[start:])
        for c in range(max(start, 1), len(self.tokens) + 1):  # continuation start c
            for n in range(min_n, min(max_n, c) + 1):
                self.follow[tuple(self.tokens[c - n : c])].append(c)


class NgramDrafter(Drafter):
    """Prompt lookup with several continuations merged into a tree.

    :meth:`propose` merges whole continuations into a trie (the default). :meth:`expand`
    serves the tree builder: the draft distribution after any path is the (match-length
    weighted) share of earlier occurrences of the path's suffix that continue with each token.
    """

    name = "ngram"
    drafts_with_builder = True

    def __init__(self, options: NgramOptions | None = None) -> None:
        self.options = options or NgramOptions()
        self.candidates_per_node = self.options.max_matches  # each match adds at most one token
        self._index: dict[Hashable, _Index] = {}

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        return [self._propose_one(r) for r in requests]

    def expand(self, requests: Sequence[DraftRequest], frontiers: Sequence[Sequence[int]],
               partials: Sequence["PartialTree"], k: int, shaping: "SamplingParams | None",
               entropy: bool = True) -> Candidates:
        """The top-``k`` continuations after each frontier node, by (match-length weighted) share,
        scaled by ``L / (L + 1)`` for the row's longest match ``L`` (see the module docstring).

        Sampling shapes the share like the target's logits (its log is the logit). The entropies
        come with the shares at no cost: they are returned whatever ``entropy`` says."""
        rows = sum(len(f) for f in frontiers)
        # the history a lookup reads: its longest key and its longest match (not a copy of it all per node)
        context = max(MAX_MATCH, self.options.max_n)
        ids = torch.zeros(rows, k, dtype=torch.int64)
        probs = torch.zeros(rows, k)
        ents = torch.zeros(rows)
        row = 0
        for req, front, part in zip(requests, frontiers, partials):
            index = self._indexed(req)
            for node in front:
                drafted = part.path_tokens(node)[1:]  # the root is the last committed token
                counts: dict[int, float] = defaultdict(float)
                matches = self._matches(index, index.tokens[-context:] + drafted)
                for weight, c in matches:
                    counts[index.tokens[c]] += weight
                if counts:
                    dist = self._shape(counts, shaping)
                    ents[row] = -sum(p * math.log(p) for p in dist.values() if p > 0)
                    longest = max(w for w, _ in matches)
                    top = sorted(dist.items(), key=lambda t: -t[1])[:k]
                    ids[row, : len(top)] = torch.tensor([t for t, _ in top])
                    probs[row, : len(top)] = torch.tensor([p for _, p in top]) * (longest / (longest + 1))
                row += 1
        return Candidates(ids, probs, ents)

    @staticmethod
    def _shape(counts: dict[int, float], shaping: "SamplingParams | None") -> dict[int, float]:
        """The draft distribution of one row: shares, or for sampling the shares' logs shaped
        like the target's logits (temperature, top-k, top-p)."""
        total = sum(counts.values())
        if shaping is None or shaping.greedy:
            return {t: w / total for t, w in counts.items()}
        toks = list(counts)
        logits = torch.log(torch.tensor([counts[t] / total for t in toks]))
        p = process_logits(logits, shaping.temperature, shaping.top_k, shaping.top_p)
        return dict(zip(toks, p.tolist()))

    def can_draft(self, requests: Sequence[DraftRequest]) -> list[bool]:
        """Whether each request's committed suffix occurs earlier with a token after it: the
        lookup :meth:`propose` starts from (the index brought up to date as it would be)."""
        return [cls > 0 for cls in self.evidence(requests)]

    def evidence(self, requests: Sequence[DraftRequest]) -> list[int]:
        """The longest match of each request's committed suffix, as a class: 0 without a match,
        then 1, 2-3, 4-7, 8-15, 16-31 and 32 tokens (``length.bit_length()``): a passage being
        copied is accepted far more often than a continuation after one shared token."""
        context = max(MAX_MATCH, self.options.max_n)
        for index in (indexes := [self._indexed(r) for r in requests]):
            if index.evidence is None:  # asked once per committed suffix (can_draft asks too)
                longest = max((w for w, _ in self._matches(index, index.tokens[-context:])), default=0.0)
                index.evidence = int(longest).bit_length()
        return [int(index.evidence) for index in indexes]

    def release(self, request_id: Hashable) -> None:
        self._index.pop(request_id, None)

    def _indexed(self, req: DraftRequest) -> _Index:
        index = self._index.setdefault(req.request_id, _Index())
        index.extend(req.token_ids, self.options.min_n, self.options.max_n)
        return index

    def _matches(self, index: _Index, context: Sequence[int]) -> list[tuple[float, int]]:
        """Earlier occurrences of ``context``'s suffix as ``(weight, c)``: ``index.tokens[c]``
        followed the suffix; found longest key first, most recent first; weight = the match
        length, extended back past the key up to ``MAX_MATCH`` tokens."""
        opt, toks = self.options, index.tokens
        seen: set[int] = set()
        found: list[tuple[float, int]] = []
        for n in range(min(opt.max_n, len(context)), opt.min_n - 1, -1):
            for c in reversed(index.follow.get(tuple(context[len(context) - n :]), ())):
                if c >= len(toks) or c in seen:
                    continue
                seen.add(c)
                length = n
                while length < min(MAX_MATCH, c, len(context)) and toks[c - length - 1] == context[-length - 1]:
                    length += 1
                found.append((float(length), c))
                if len(found) >= opt.max_matches:
                    return found
        return found

    def _propose_one(self, req: DraftRequest) -> DraftTree:
        index = self._indexed(req)
        if req.max_nodes <= 0 or req.max_depth <= 0:
            return DraftTree.root_only(req.root)
        toks = index.tokens
        conts = [(w, toks[c : c + req.max_depth]) for w, c in self._matches(index, toks)]
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


def parse_ngram_options(options: str | None) -> NgramOptions:
    """Parse ``key=value`` pairs (``min_n``, ``max_n``, ``max_matches``), comma separated."""
    if not options:
        return NgramOptions()
    fields: dict[str, str] = {}
    for part in options.split(","):
        key, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"ngram option {part!r} must look like key=value (min_n, max_n, max_matches)")
        fields[key.strip()] = value.strip()
    return NgramOptions(**fields)
