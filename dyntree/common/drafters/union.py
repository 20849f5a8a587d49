"""Several drafters as one: every tree node is offered the candidates of each of them.

``--drafter hydra+ngram`` grows one tree from the trained heads and the n-gram index together:
at every node the builder sees the union of both drafters' candidates, a token both propose
keeping the larger of its two probabilities, and keeps the best ``k``. A passage the text repeats
(an n-gram match, confidence ``L / (L + 1)`` for a match of ``L`` tokens) then wins its place in
the tree over an unsure head; where nothing matches, the heads' tree is what it was alone; below
the heads' last depth the n-gram index alone extends a matched path.

Each part sees every call (hidden states, verified tokens, releases) as it would alone. Any
proposal is lossless (the verifier reads the tree's probabilities; sampled trees renormalise
them), so the union needs no correction. Parts must draft through the builder (``expand``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Hashable, Sequence

import torch

from dyntree.common.drafter import Candidates, DraftRequest, Drafter

if TYPE_CHECKING:
    from dyntree.common.builder import PartialTree
    from dyntree.common.config import SamplingParams
    from dyntree.kernels.cpu_linear import LinearDispatch

__all__ = ["UnionDrafter", "merge_candidates"]


def merge_candidates(parts: Sequence[Candidates], k: int) -> Candidates:
    """Per row, the ``k`` most likely tokens of the union of ``parts`` (same rows, any widths): a
    token offered by several keeps its largest probability; empty slots (probability 0) stay out.
    The entropy is the first part's where that part had a candidate for the row, else the next's
    (``None`` if the first part carries none). A part's own candidates are distinct tokens."""
    offering = [p for p in parts if bool((p.probs > 0).any())] or list(parts[:1])
    if len(offering) == 1 and offering[0].probs.shape[1] >= k:
        # one part offers anything (text no n-gram matches): its own candidates, nothing to merge
        ids, probs = offering[0].ids, offering[0].probs
    else:
        ids = torch.cat([p.ids for p in parts], dim=1)
        probs, order = torch.cat([p.probs for p in parts], dim=1).sort(dim=1, descending=True, stable=True)
        ids = ids.gather(1, order)
        live = probs > 0
        same = (ids[:, :, None] == ids[:, None, :]) & live[:, None, :]
        earlier = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril(-1)  # [i, j]: j before i
        probs.masked_fill_((same & earlier).any(-1), 0.0)  # a repeat of a likelier slot
    top, at = probs.topk(min(k, probs.shape[1]), dim=1)
    entropy = None
    if parts[0].entropy is not None:
        entropy = parts[0].entropy.clone()
        covered = parts[0].probs[:, 0] > 0
        for p in parts[1:]:
            if p.entropy is not None:
                entropy = torch.where(covered, entropy, p.entropy)
                covered |= p.probs[:, 0] > 0
    return Candidates(ids.gather(1, at).masked_fill(top == 0, 0), top, entropy)


class UnionDrafter(Drafter):
    """The union of ``parts`` (see the module docstring); the first part leads: its acceptance
    table, prior and candidate count are the union's."""

    def __init__(self, parts: Sequence[Drafter]) -> None:
        if len(parts) < 2:
            raise ValueError("a union drafter needs at least two drafters")
        for p in parts:
            if not p.drafts_with_builder or p.needs_self_draft:
                raise ValueError(f"drafter {p.name!r} cannot be part of a union: only drafters that grow trees "
                                 "through the builder's expand without the engine's forward can")
        self.parts = list(parts)
        self.name = "+".join(p.name for p in parts)  # type: ignore[misc]
        lead = parts[0]
        self.needs_hidden = any(p.needs_hidden for p in parts)
        depths = [p.max_depth for p in parts]
        self.max_depth = None if None in depths else max(d for d in depths if d is not None)
        self.beam_width, self.beam_topk = lead.beam_width, lead.beam_topk
        self.acceptance_prior, self.acceptance_table = lead.acceptance_prior, lead.acceptance_table
        self.candidates_per_node = lead.candidates_per_node

    def expand(self, requests: Sequence[DraftRequest], frontiers: Sequence[Sequence[int]],
               partials: Sequence["PartialTree"], k: int, shaping: "SamplingParams | None",
               entropy: bool = True) -> Candidates:
        return merge_candidates([p.expand(requests, frontiers, partials, k, shaping, entropy) for p in self.parts], k)

    @property
    def knows_availability(self) -> bool:
        return all(p.knows_availability for p in self.parts)

    def can_draft(self, requests: Sequence[DraftRequest]) -> list[bool] | None:
        """Any part would draft (unknown if a part cannot tell: the others are not asked)."""
        if not self.knows_availability:
            return None
        answers = [p.can_draft(requests) for p in self.parts]
        if any(a is None for a in answers):
            return None
        return [any(col) for col in zip(*answers)]  # type: ignore[arg-type]

    def observe_hidden(self, request_id: Hashable, states: torch.Tensor, start: int | None = None) -> None:
        for p in self.parts:
            if p.needs_hidden:
                p.observe_hidden(request_id, states, start)

    def observe_hidden_rows(self, request_ids: Sequence[Hashable], states: torch.Tensor,
                            starts: Sequence[int | None]) -> None:
        for p in self.parts:
            if p.needs_hidden:
                p.observe_hidden_rows(request_ids, states, starts)

    def catch_up(self, requests: Sequence[DraftRequest]) -> list[int]:
        return [sum(col) for col in zip(*(p.catch_up(requests) for p in self.parts))]

    def pop_catch_up(self) -> tuple[float, int]:
        spent = [p.pop_catch_up() for p in self.parts]
        return sum(ms for ms, _ in spent), sum(n for _, n in spent)

    def observe(self, request_id: Hashable, committed: Sequence[int], accepted_drafts: int) -> None:
        for p in self.parts:
            p.observe(request_id, committed, accepted_drafts)

    def release(self, request_id: Hashable) -> None:
        for p in self.parts:
            p.release(request_id)

    def route_linears(self, dispatch: "LinearDispatch | None") -> None:
        for p in self.parts:
            p.route_linears(dispatch)
