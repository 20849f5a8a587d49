"""The drafter contract: what every draft source (n-gram lookup, Hydra heads, quantized
self-draft) implements. Engine-neutral: a drafter sees request ids and token ids, hidden states
pushed to it, and (the self-draft only) a small forward protocol an engine implements; never an
engine's cache, batch rows or model classes.

A drafter offers one or both of

* :meth:`Drafter.expand`: top-k candidates for the token after each frontier node of trees under
  construction, one batched call per depth; the :class:`~dyntree.common.builder.TreeBuilder`
  grows every tree shape from it (``chain``, ``static``, ``dyntree``, and ``beam``, the drafter's
  own best-first shape);
* :meth:`Drafter.propose`: whole trees at once (the n-gram trie of continuations).

The registry that turns a ``--drafter`` spec into an instance is :mod:`dyntree.common.drafters`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Hashable, Protocol, Sequence

import torch

from dyntree.common.calibration import AcceptanceTable, entropy
from dyntree.common.sampling import process_logits
from dyntree.common.tree import DraftTree

if TYPE_CHECKING:
    from dyntree.common.builder import PartialTree
    from dyntree.common.config import SamplingParams
    from dyntree.common.quant import WeightKernel
    from dyntree.kernels.cpu_linear import LinearDispatch

__all__ = ["DraftRequest", "Candidates", "top_candidates", "topk_rows", "Drafter", "NoDrafter", "TargetInfo",
           "SelfDraftBackend"]


@dataclass(frozen=True)
class DraftRequest:
    """What a drafter knows of one request in one step.

    Attributes:
        request_id: engine-unique id, stable for the request's life.
        token_ids: all committed tokens (prompt + generated); the last one is the tree root,
            the ones before it are in the target's KV cache (``kv_len`` of them).
        max_nodes: the most *draft* nodes the tree may hold (the root is not counted).
        max_depth: the deepest a draft node may sit (root depth 0).
    """

    request_id: Hashable
    token_ids: Sequence[int]
    max_nodes: int
    max_depth: int

    @property
    def root(self) -> int:
        return int(self.token_ids[-1])

    @property
    def kv_len(self) -> int:
        """Committed tokens whose KV the target holds (all but the root)."""
        return len(self.token_ids) - 1


@dataclass(frozen=True)
class Candidates:
    """Top-k next-token candidates for ``F`` frontier rows (flat over a batch, in request order).

    Attributes:
        ids: ``[F, k]`` int64 token ids, most likely first.
        probs: ``[F, k]`` float32 draft probabilities (0: no candidate in that slot; a row of
            zeros: the node gets no children).
        entropy: ``[F]`` float32 entropy (nats) of the row's *whole* draft distribution;
            ``None`` when the caller did not ask for it (``expand(..., entropy=False)``).
    """

    ids: torch.Tensor
    probs: torch.Tensor
    entropy: torch.Tensor | None

    def __post_init__(self) -> None:
        if (self.ids.dim() != 2 or self.probs.shape != self.ids.shape
                or (self.entropy is not None and self.entropy.shape != self.ids.shape[:1])):
            raise ValueError(
                f"Candidates: ids {tuple(self.ids.shape)}, probs {tuple(self.probs.shape)} and entropy "
                f"{None if self.entropy is None else tuple(self.entropy.shape)} must be [F, k], [F, k] and [F] (or None)"
            )

    @classmethod
    def empty(cls, rows: int, k: int = 1, entropy: bool = True) -> "Candidates":
        """``rows`` rows without candidates (zero entropies, or none)."""
        return cls(torch.zeros(rows, k, dtype=torch.int64), torch.zeros(rows, k), torch.zeros(rows) if entropy else None)

    def split(self, counts: Sequence[int]) -> list["Candidates"]:
        """Per-tree views: the first ``counts[0]`` rows, the next ``counts[1]``, ..."""
        if len(counts) == 1 and counts[0] == self.ids.shape[0]:  # one tree: these candidates
            return [self]
        out, start = [], 0
        for n in counts:
            ent = None if self.entropy is None else self.entropy[start : start + n]
            out.append(Candidates(self.ids[start : start + n], self.probs[start : start + n], ent))
            start += n
        if start != self.ids.shape[0]:
            raise ValueError(f"Candidates has {self.ids.shape[0]} rows, the frontiers {start}")
        return out


#: Block width of :func:`topk_rows`.
TOPK_BLOCK = 512


def topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, k, dim=-1)`` of ``[F, V]`` rows, in two small top-k's where ``V`` splits into
    blocks of :data:`TOPK_BLOCK` and ``k`` is at most a twelfth of the blocks: the ``k`` largest
    entries lie in the ``k`` blocks with the largest maxima (ties aside), so only those ``k``
    blocks are searched (beyond a twelfth, or with few blocks, one top-k was as fast or faster:
    ``docs/measurements.md``)."""
    f, v = x.shape
    blocks = v // TOPK_BLOCK
    if v % TOPK_BLOCK or 12 * k > blocks:
        return torch.topk(x, k, dim=-1)
    rows = x.view(f, blocks, TOPK_BLOCK)
    top_blocks = torch.topk(rows.amax(-1), k, dim=-1).indices
    inside = rows.gather(1, top_blocks[..., None].expand(f, k, TOPK_BLOCK)).view(f, k * TOPK_BLOCK)
    values, at = torch.topk(inside, k, dim=-1)
    return values, top_blocks.gather(1, at // TOPK_BLOCK) * TOPK_BLOCK + at % TOPK_BLOCK


def top_candidates(
    logits: torch.Tensor, k: int, shaping: "SamplingParams | None" = None, token_map: torch.Tensor | None = None,
    with_entropy: bool = True,
) -> Candidates:
    """Candidates from dense draft logits ``[F, V']`` (on the drafter's device; moved to the CPU).

    ``shaping`` ``None`` (greedy target): plain softmax; otherwise the target's temperature /
    top-k / top-p applied exactly as to the target's logits. ``token_map`` maps column ``j`` to a
    full token id (a drafter over a reduced vocabulary). Rows of all ``-inf`` get no candidates.
    ``with_entropy=False`` skips the rows' entropies (a log-softmax and three passes over the
    vocabulary).
    """
    x = logits.float()
    ent = None
    if shaping is None or shaping.greedy:
        if with_entropy:  # from the log-probabilities: no log of probs
            logp = torch.log_softmax(x, dim=-1)
            probs = logp.exp()
            ent = -(probs * logp.clamp_min_(torch.finfo(logp.dtype).min)).sum(-1)  # 0 log 0 = 0 at -inf logits
        else:
            probs = torch.softmax(x, dim=-1)
    else:
        probs = process_logits(x, shaping.temperature, shaping.top_k, shaping.top_p)
        ent = entropy(probs) if with_entropy else None
    # a row of all -inf: NaN probabilities (softmax over nothing), so a NaN entropy and first probability
    lead = ent if ent is not None else probs[:, 0]
    if any(math.isnan(v) for v in lead.tolist()):
        dead = lead.isnan() & torch.isneginf(x.amax(dim=-1))  # a NaN logit stays NaN: the builder refuses it
        probs.masked_fill_(dead[:, None], 0.0)
        if ent is not None:
            ent.masked_fill_(dead, 0.0)
    top_p, top_i = topk_rows(probs, min(k, probs.shape[-1]))
    if token_map is not None:
        top_i = token_map[top_i]
    return Candidates(top_i.cpu(), top_p.cpu(), None if ent is None else ent.cpu())


@dataclass(frozen=True)
class TargetInfo:
    """What a drafter may borrow from the target model (engines fill it from their own model).

    Attributes:
        name: a human-readable model name (messages only).
        hidden_size: width of the target's last hidden state.
        embed: ``[vocab, hidden]`` input-embedding weight (frozen, shared, never copied).
        lm_head: ``[vocab, hidden]`` LM-head weight (frozen, shared).
        tokenizer_sha256: hash of the tokenizer's vocabulary
            (:func:`~dyntree.common.hydra.tokenizer_sha256`).
        weight_kernel: a low-bit matmul the engine offers for a drafter's own weights on the
            target's device (the standalone engine on a CPU: torch's weight-only int8), or ``None``.
    """

    name: str
    hidden_size: int
    embed: torch.Tensor
    lm_head: torch.Tensor
    tokenizer_sha256: str
    weight_kernel: "WeightKernel | None" = None

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.shape[0])

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer: Any, name: str, vocab: int | None = None,
                   weight_kernel: "WeightKernel | None" = None) -> "TargetInfo":
        """From a loaded causal LM of any engine (``model.model.embed_tokens``, else HF-style
        ``get_input_embeddings()``; ``lm_head``, else tied to the embedding), weights shared, rows
        cut to ``vocab`` (an engine's padded vocabulary). The decoder's own embedding comes first:
        some engines' ``get_input_embeddings`` takes token ids and returns embeddings."""
        from dyntree.common.hydra import tokenizer_sha256

        inner = getattr(getattr(model, "model", None), "embed_tokens", None)
        if isinstance(getattr(inner, "weight", None), torch.Tensor):
            embed = inner.weight
        else:
            get_embed = getattr(model, "get_input_embeddings", None)
            if not callable(get_embed):
                raise ValueError(f"{type(model).__name__} has neither model.embed_tokens nor get_input_embeddings()")
            embed = get_embed().weight
        head = getattr(model, "lm_head", None)
        lm_head = head.weight if isinstance(getattr(head, "weight", None), torch.Tensor) else embed
        rows = slice(None) if vocab is None else slice(0, vocab)
        return cls(name=str(name), hidden_size=int(embed.shape[1]), embed=embed.detach()[rows],
                   lm_head=lm_head.detach()[rows], tokenizer_sha256=tokenizer_sha256(tokenizer),
                   weight_kernel=weight_kernel)


class SelfDraftBackend(Protocol):
    """What the quantized self-draft needs from an engine: a forward of its draft layers over draft
    tokens against each request's committed prefix KV (read-only), keeping the draft tokens' own
    KV in a scratch area for one speculation step.

    Scratch slots are numbered in the order tokens were forwarded: a forward of ``W`` tokens per
    request appends slots ``S .. S + W - 1`` (``S``: slots so far this step) for every request.
    """

    def reset(self, requests: Sequence[DraftRequest]) -> None:
        """Start a step for ``requests`` (in this order): drop the scratch KV."""

    def release(self) -> None:
        """The step is over (verified, or no node can grow deeper): free the scratch KV."""

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, scratch_mask: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[B, W, V]`` of ``tokens`` ``[B, W]`` at ``positions`` ``[B, W]``.

        Query ``(b, w)`` attends to request ``b``'s whole committed prefix and to the scratch
        slots (and this call's own tokens, the last ``W`` columns) where ``scratch_mask`` ``[B, W,
        S + W]`` is True. Rows of padding queries are garbage."""
        ...


class Drafter:
    """Proposes draft trees; subclasses implement :meth:`expand`, :meth:`propose` or both.

    Attributes:
        name: registry name.
        needs_hidden: the speculator forwards the target's last-layer hidden states of committed
            tokens to :meth:`observe_hidden` (engines push them; see ``Speculator.observe_hidden``).
        needs_self_draft: the engine must :meth:`attach` a :class:`SelfDraftBackend` before use.
        max_depth: the deepest this drafter can draft (``None``: no limit); budgets are clamped.
        beam_width / beam_topk: defaults of the ``beam`` tree (``None``: spread the node budget
            evenly over the depths; ``topk`` = width).
        acceptance_prior: the top-1 acceptance the adaptive controller assumes before it has
            observed any (``None``: its ``alpha_prior`` option); set by drafters whose kind says
            much more than a generic prior (a self-draft is mostly the target itself).
        acceptance_table: the measured acceptance of this drafter's candidates per depth, rank and
            confidence (:class:`~dyntree.common.calibration.AcceptanceTable`), the tree builder's
            starting calibration (``None``: the confidences are taken at face value).
        candidates_per_node: the most candidates :meth:`expand` gives one node when they are few
            and each backed by evidence (n-gram matches): the dynamic tree then offers all of them
            and lets the calibrated values choose, instead of its entropy rule (``None``).
        level_cost_share: what drafting one tree level for one request costs, as a share of one
            target forward of one token: the adaptive controller's starting price for it (its
            ``draft_ms_per_depth_row``, refined online) unless that option is set (``None``: the
            option's own). Set by drafters that run a forward of their own per level (a
            self-draft), so that an engine's first plans do not take their drafting for free.
    """

    name: ClassVar[str] = ""
    needs_hidden: bool = False
    needs_self_draft: ClassVar[bool] = False
    max_depth: int | None = None
    beam_width: int | None = None
    beam_topk: int | None = None
    acceptance_prior: float | None = None
    acceptance_table: AcceptanceTable | None = None
    candidates_per_node: int | None = None
    level_cost_share: float | None = None

    @property
    def drafts_with_builder(self) -> bool:
        """Implements :meth:`expand` (every builder tree shape works)."""
        return type(self).expand is not Drafter.expand

    @property
    def has_evidence(self) -> bool:
        """Implements :meth:`evidence` (a class of what it knows before drafting), which a quiet
        step asks about (:meth:`~dyntree.common.speculator.Speculator.quiet`)."""
        return type(self).evidence is not Drafter.evidence

    @property
    def knows_availability(self) -> bool:
        """Implements :meth:`can_draft` (it knows beforehand which requests it has nothing for), so
        a step it has nothing for at all decodes plainly without a plan
        (:meth:`~dyntree.common.speculator.Speculator.quiet`)."""
        return type(self).can_draft is not Drafter.can_draft

    @property
    def has_own_trees(self) -> bool:
        """Implements :meth:`propose` (``SpecConfig.tree`` unset uses it; else the ``beam`` tree)."""
        return type(self).propose is not Drafter.propose

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        """One tree per request, in order, within its budget; a tree may be just the root."""
        raise NotImplementedError(f"drafter {self.name!r} does not propose whole trees")

    def expand(
        self,
        requests: Sequence[DraftRequest],
        frontiers: Sequence[Sequence[int]],
        partials: Sequence["PartialTree"],
        k: int,
        shaping: "SamplingParams | None",
        entropy: bool = True,
    ) -> Candidates:
        """Top-``k`` candidates for the token after every frontier node, flat over the batch.

        Called once per depth. ``frontiers[b]`` lists node indices of ``partials[b]`` (the tree
        being grown for ``requests[b]``; ``partials[b].path_tokens(i)`` gives the tokens from the
        root to node ``i``); a call whose partial trees hold only their roots starts a new step.
        Returns ``sum(len(f) for f in frontiers)`` rows in request then frontier order, shaped by
        ``shaping`` as :func:`top_candidates` does. ``entropy=False``: the tree being grown reads no
        entropies (only ``dyntree`` trees do), so the drafter may skip them (``Candidates.entropy``
        ``None``).
        """
        raise NotImplementedError(f"drafter {self.name!r} has no expand (its trees come from propose)")

    def can_draft(self, requests: Sequence[DraftRequest]) -> list[bool] | None:
        """Whether this step's draft of each request would hold any node, known before planning
        for a drafter that finds out cheaply (n-gram: does the suffix match anywhere?); the
        controller then plans only for those that would, instead of pricing every plan with the
        drafter's average delivery. ``None``: unknown until drafted (the default)."""
        return None

    def evidence(self, requests: Sequence[DraftRequest]) -> list[int] | None:
        """Per request, a small class (0, 1, 2, ...) of what the drafter knows before drafting that
        moves how often its first draft is accepted (n-gram: how long a match the committed suffix
        has); the controller learns acceptance per class and plans each request by its class's.
        ``None``: nothing known beforehand (the default)."""
        return None

    def route_linears(self, dispatch: "LinearDispatch | None") -> None:
        """Route the drafter's own few-row linears by the engine's CPU dispatch
        (:mod:`dyntree.kernels.cpu_linear`; ``None``: stock ``F.linear``). Default: it has none."""

    def attach(self, backend: SelfDraftBackend) -> None:
        """Take the engine's self-draft forward (drafters with ``needs_self_draft``)."""
        raise TypeError(f"drafter {self.name!r} drafts without the engine's forward")

    def observe_hidden(self, request_id: Hashable, states: torch.Tensor, start: int | None = None) -> None:
        """``states`` ``[n, d]``: the target's last-layer hidden states (the LM-head input) of the
        request's next ``n`` committed positions, in order (first the prompt's, then each step's
        accepted nodes, root first); ``start`` is the first row's position when the engine says
        it. Only called when ``needs_hidden``."""

    def observe_hidden_rows(self, request_ids: Sequence[Hashable], states: torch.Tensor,
                            starts: Sequence[int | None]) -> None:
        """One committed position per request (a plain decoding step's): row ``i`` of ``states``
        ``[len(request_ids), d]`` is request ``request_ids[i]``'s, at position ``starts[i]``
        when the engine says it, as :meth:`observe_hidden` takes them one by one (the default)."""
        for i, (rid, start) in enumerate(zip(request_ids, starts)):
            self.observe_hidden(rid, states[i : i + 1], start)

    def catch_up(self, requests: Sequence[DraftRequest]) -> list[int]:
        """Per request, the committed positions its next draft must first bring the drafter's own
        state up to date with (its first draft, or its first after steps it did not draft):
        paid once, at that draft, so the controller prices it there. Default: none."""
        return [0] * len(requests)

    def pop_catch_up(self) -> tuple[float, int]:
        """Milliseconds and positions spent catching up (:meth:`catch_up`) since the last call:
        the speculator learns the price per position from them and leaves them out of the
        per-step drafting cost. Default: none."""
        return 0.0, 0

    def observe(self, request_id: Hashable, committed: Sequence[int], accepted_drafts: int) -> None:
        """After each verify step: the tokens it committed for the request (its accepted drafts,
        then the bonus token) and how many drafts were accepted."""

    def release(self, request_id: Hashable) -> None:
        """The request finished; drop any per-request state."""


class NoDrafter(Drafter):
    """Plain decoding through the same engine: every tree is just the root."""

    name = "none"

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        return [DraftTree.root_only(r.root) for r in requests]
