"""One vLLM engine step as the plugin sees it: the explicit record the runner hooks
(:mod:`dyntree.vllm_plugin.runner`) build and hand on by argument, to the proposer
(:meth:`~dyntree.vllm_plugin.proposer.DynTreeProposer.begin_step`) and to the tree attention
metadata builders (:mod:`dyntree.vllm_plugin.attention`), never through module globals.

:class:`TreeStep` is the host metadata of the step's trees (which requests carry one, where their
rows start, their prefix lengths and ancestor masks, one flat
:class:`~dyntree.common.tree.DraftBatch`); :class:`StepRecord` the whole step (request ids and
sampling, committed lengths, query starts, forward timing, the trees); :func:`plan_trees` builds
the former from what vLLM scheduled. ``DYNTREE_VLLM_ABLATE`` (:func:`ablations`) switches one piece
of tree verification off, a test control whose outputs must then differ from plain decoding.
:func:`tree_builders` and :func:`layer_caches` find a runner's tree attention builders and its
layers' KV caches (the runner hooks and the self-draft read both).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Hashable, Mapping, Protocol, runtime_checkable

import numpy as np
import torch

from dyntree.common.config import SamplingParams
from dyntree.common.speculator import AcceptResult
from dyntree.common.tree import DraftBatch, DraftTree

if TYPE_CHECKING:
    from dyntree.vllm_plugin.attention import TreeAttentionPlan

__all__ = ["TreeStep", "StepRecord", "Move", "TreeAttentionBuilder", "ablations", "layer_caches", "plan_trees",
           "refuse_attention_features", "tree_builders"]


def refuse_attention_features(soft_cap: float | None, sinks: object, alibi: object, sliding: bool) -> None:
    """A tree attention backend's start-up fence: the attention features its tree rows do not
    reproduce, refused by name when the model's layers use one."""
    if soft_cap or sinks is not None or alibi is not None or sliding:
        raise RuntimeError("dyntree tree attention does not support logit soft-capping, attention sinks, ALiBi "
                           "or sliding windows (this model uses one); drop method 'dyntree'")


def ablations() -> frozenset[str]:
    return frozenset(a.strip() for a in os.environ.get("DYNTREE_VLLM_ABLATE", "").split(",") if a.strip())


@dataclass
class TreeStep:
    """Host metadata of one step's trees (request ``b`` of ``batch`` is batch row ``rows[b]``)."""

    batch: DraftBatch
    rows: list[int]  # input-batch index of each tree request
    starts: list[int]  # first query row of each tree request
    prefix: list[int]  # committed tokens before each root (its KV is cached)
    masks: list[torch.Tensor]  # [T, T] bool: the nodes each node may attend to within its tree
    accept: AcceptResult | None = None
    attention: "list[TreeAttentionPlan]" = field(default_factory=list)  # what the CPU builders planned from it

    @property
    def attention_ms(self) -> float:
        """Time the layers spent on tree rows beside vLLM's kernel this step (CPU; on a GPU it is
        part of the forward's time). In a step of branching trees only it is spent instead of
        that kernel, so a branching tree's learned price errs high by the kernel's time, leaning
        plans toward chains."""
        return sum(p.spent_ms for p in self.attention)

    @cached_property
    def branching(self) -> list[int]:
        """The trees (indices into ``batch``) whose rows need tree attention: every tree whose mask is
        not causal (a chain's nodes see exactly what causal attention shows them, so vLLM's kernel
        serves it). Computed once per step."""
        if not self.batch.num_drafts:
            return []
        return [b for b, (t, m) in enumerate(zip(self.batch.trees, self.masks))
                if t.lead_chain < t.size and not bool(torch.equal(m, torch.tril(torch.ones_like(m))))]

    def moves(self) -> "list[Move]":
        """After :attr:`accept`: the requests whose accepted nodes are not already in place (KV compaction)."""
        assert self.accept is not None
        index, length = self.accept.accept_index, self.accept.accept_len
        cols = torch.arange(index.shape[1])
        moved = ((index != cols) & (cols < length[:, None])).any(1).nonzero().flatten().tolist()
        return [Move(self.rows[b], self.prefix[b], index[b, : int(length[b])].clone()) for b in moved]


@dataclass(frozen=True)
class Move:
    """One request's KV compaction: its accepted ``nodes`` (tree indices, root first) move to
    positions ``prefix .. prefix + len(nodes) - 1`` of batch row ``row``'s blocks."""

    row: int
    prefix: int
    nodes: torch.Tensor


@runtime_checkable
class TreeAttentionBuilder(Protocol):
    """What the runner hooks ask of a tree attention metadata builder (one per KV-cache group; CPU:
    :class:`~dyntree.vllm_plugin.attention.TreeCPUAttentionMetadataBuilder`, CUDA:
    :class:`~dyntree.vllm_plugin.triton_attention.TreeTritonAttentionMetadataBuilder`)."""

    layers: dict[str, int]  # its layers' names

    def plan_trees(self, step: TreeStep | None) -> None:
        """The trees of the step whose metadata the builder's ``build`` builds next."""

    def release(self, request_id: str) -> None:
        """The request ended or is recomputed from the start."""

    def compact(self, kv_caches: Mapping[str, torch.Tensor], block_table: Any, moves: "list[Move]") -> None:
        """Apply ``moves`` to every one of its layers' caches (``kv_caches`` by layer name;
        ``block_table``: vLLM's block table of the group, host and device rows)."""

    def commit(self, step: TreeStep) -> None:
        """After the step's verification and compaction: its accepted nodes are its requests'
        next committed positions (whatever the builder keeps beside vLLM's cache follows)."""


def tree_builders(runner: Any) -> list[TreeAttentionBuilder]:
    """The runner's tree attention builders, found once per set of attention groups (a protocol
    ``isinstance`` check per builder is too slow for every step)."""
    cached = getattr(runner, "_dyntree_builders", None)
    if cached is None or cached[0] is not runner.attn_groups:
        builders = [group.get_metadata_builder() for groups in runner.attn_groups for group in groups]
        cached = (runner.attn_groups, [b for b in builders if isinstance(b, TreeAttentionBuilder)])
        runner._dyntree_builders = cached
    return cached[1]


def layer_caches(runner: Any) -> dict[str, torch.Tensor]:
    """Every attention layer's KV cache tensor, by layer name (layers without one left out)."""
    caches = {}
    for name, layer in runner.compilation_config.static_forward_context.items():
        kv = getattr(layer, "kv_cache", None)
        if isinstance(kv, (list, tuple)):
            kv = kv[0] if kv else None
        if isinstance(kv, torch.Tensor) and kv.numel():
            caches[name] = kv
    return caches


@dataclass
class StepRecord:
    """One engine step as the adapter sees it (batch row ``i`` is request ``req_ids[i]``)."""

    req_ids: list[str]
    params: dict[str, SamplingParams | None]  # None: the request decodes plainly
    computed: np.ndarray  # committed tokens (KV cached) per row before this step
    starts: np.ndarray  # first query row per row
    scheduled: np.ndarray  # query tokens per row
    started: float  # perf_counter when the forward began
    decode_tokens: int  # the forward's query tokens when it holds decoding rows only, else 0
    tree: TreeStep | None
    limits: dict[str, int]  # per request, the most tokens (prompt included) it may reach
    waiting: int | None  # requests the scheduler holds back (None: not known)


def plan_trees(req_ids: list[str], scheduled_drafts: dict[str, list[int]], num_scheduled: np.ndarray,
               computed: np.ndarray, trees: dict[Hashable, DraftTree]) -> TreeStep | None:
    """The step's trees: every decoding request the proposer drafted for, with its scheduled drafts
    (a prefix of its proposed tree; none: a root-only tree, verified as plain decoding)."""
    if not trees and not any(scheduled_drafts.values()):  # nobody drafted (a quiet step)
        return None
    ends = num_scheduled.cumsum()
    ids, kept, rows, starts, prefix = [], [], [], [], []
    for i, rid in enumerate(req_ids):
        drafts = scheduled_drafts.get(rid) or []
        tree = trees.get(rid)
        n = len(drafts) + 1
        if int(num_scheduled[i]) != n or tree is None:
            if drafts:
                raise RuntimeError(f"dyntree: request {rid!r} was scheduled drafts that are not its proposed tree")
            continue  # a prefill chunk, or a request that does not speculate
        if tree.size < n or tree.tokens[1:n].tolist() != list(drafts):
            raise RuntimeError(f"dyntree: request {rid!r} was scheduled drafts that are not its proposed tree")
        ids.append(rid)
        kept.append(tree.prefix(n))  # the scheduler may cut a tree short: a prefix is still a tree
        rows.append(i)
        starts.append(int(ends[i]) - n)
        prefix.append(int(computed[i]))
    if not kept:
        return None
    causal = "mask" in ablations()
    masks = [torch.tril(torch.ones(t.size, t.size, dtype=torch.bool)) if causal else t.ancestor_mask() for t in kept]
    return TreeStep(DraftBatch.from_trees(ids, kept), rows, starts, prefix, masks)
