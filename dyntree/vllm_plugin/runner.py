"""Tree verification inside vLLM's V1 model runner: the per-step plan and three runner hooks.

vLLM schedules each request's draft nodes (root first) as an ordinary run of query tokens with
linear KV slots. Per step, on host metadata only (FlashInfer style), :func:`plan_step` builds a
:class:`TreeStep`: which requests carry a tree this step, where their query rows start, their
committed prefix lengths and block-table rows, and one flat
:class:`~dyntree.common.tree.DraftBatch`. Then

* ``_prepare_inputs`` (after vLLM's own): tree rows get RoPE positions ``prefix + depth``
  (slots stay linear);
* the attention backend (:mod:`dyntree.vllm_plugin.attention`) lets a tree node see the prefix
  and its ancestors only;
* ``_sample`` (after vLLM's own, which still serves every request without a tree): the
  speculator verifies the trees (greedy or lossless sampling), the accepted path plus bonus
  replaces the request's row of ``sampled_token_ids`` (``-1`` padded, so the scheduler rolls
  back exactly the rejected slots), and the accepted nodes' KV moves to positions
  ``prefix .. prefix + len - 1`` (compaction);
* ``propose_draft_token_ids`` (before vLLM's own): the proposer learns the batch's request ids and
  sampling parameters, and drafters that read hidden states get the committed tokens' states.

``DYNTREE_VLLM_ABLATE`` (``mask``, ``positions``, ``compaction``; comma separated) switches one
piece off: a test control whose outputs must then differ from plain decoding.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Hashable

import torch

from dyntree.common.config import SamplingParams
from dyntree.common.speculator import AcceptResult
from dyntree.common.tree import DraftBatch
from dyntree.vllm_plugin.kv_layout import KVLayout
from dyntree.vllm_plugin.proposer import DynTreeProposer

__all__ = ["TreeStep", "current_step", "ablations", "install"]

_STEP: "TreeStep | None" = None


def ablations() -> frozenset[str]:
    return frozenset(a.strip() for a in os.environ.get("DYNTREE_VLLM_ABLATE", "").split(",") if a.strip())


def current_step() -> "TreeStep | None":
    """The running step's tree plan (``None``: no tree in this forward)."""
    return _STEP


@dataclass
class TreeStep:
    """Host metadata of one step's trees (request ``b`` of ``batch`` is batch row ``rows[b]``)."""

    batch: DraftBatch
    rows: list[int]  # input-batch index of each tree request
    starts: list[int]  # first query row of each tree request
    prefix: list[int]  # committed tokens before each root (its KV is cached)
    masks: list[torch.Tensor]  # [T, prefix + T] bool: what each node may attend to
    accept: AcceptResult | None = None
    derived: dict[Any, Any] = field(default_factory=dict)  # per-step host plans (attention indices), by key


def _proposer(runner: Any) -> DynTreeProposer | None:
    """The runner's dyntree drafter (``None`` for a runner without one: another engine in this process)."""
    drafter = getattr(runner, "drafter", None)
    return drafter if isinstance(drafter, DynTreeProposer) else None


def plan_step(runner: Any, scheduler_output: Any, num_scheduled: Any, proposer: DynTreeProposer) -> TreeStep | None:
    """The step's trees: requests whose scheduled drafts are (a prefix of) the proposer's tree."""
    num_reqs = runner.input_batch.num_reqs
    req_ids = runner.input_batch.req_ids[:num_reqs]
    computed = runner.input_batch.num_computed_tokens_cpu[:num_reqs]
    ends = num_scheduled[:num_reqs].cumsum()
    ids, trees, rows, starts, prefix = [], [], [], [], []
    for i, rid in enumerate(req_ids):
        drafts = scheduler_output.scheduled_spec_decode_tokens.get(rid)
        if not drafts:
            continue
        tree = proposer.trees.get(rid)
        n = len(drafts) + 1
        if tree is None or tree.size < n or tree.tokens[1:n].tolist() != list(drafts) or int(num_scheduled[i]) != n:
            raise RuntimeError(f"dyntree: request {rid!r} was scheduled drafts that are not its proposed tree")
        ids.append(rid)
        trees.append(tree.prefix(n))  # the scheduler may cut a tree short: a prefix is still a tree
        rows.append(i)
        starts.append(int(ends[i]) - n)
        prefix.append(int(computed[i]))
    if not trees:
        return None
    batch = DraftBatch.from_trees(ids, trees)
    causal = "mask" in ablations()
    masks = []
    for tree, p in zip(trees, prefix):
        anc = torch.tril(torch.ones(tree.size, tree.size, dtype=torch.bool)) if causal else tree.ancestor_mask()
        masks.append(torch.cat([torch.ones(tree.size, p, dtype=torch.bool), anc], dim=1))
    return TreeStep(batch, rows, starts, prefix, masks)


def _prepare_inputs(orig: Any) -> Any:
    def wrapper(self: Any, scheduler_output: Any, num_scheduled_tokens: Any) -> Any:
        global _STEP
        _STEP = None
        proposer = _proposer(self)
        if proposer is not None and proposer.speculator is not None and proposer.runner is None:
            proposer.runner = self
            proposer.speculator.prepare()  # adaptive: time the cost model's forwards (the KV cache exists now)
        out = orig(self, scheduler_output, num_scheduled_tokens)
        if proposer is None or proposer.speculator is None:
            return out
        for rid in scheduler_output.finished_req_ids:
            proposer.speculator.release(rid)
        num_reqs = self.input_batch.num_reqs
        for i, rid in enumerate(self.input_batch.req_ids[:num_reqs]):
            if int(self.input_batch.num_computed_tokens_cpu[i]) == 0:  # new or recomputed after preemption
                proposer.speculator.release(rid)
        self._dyntree_computed = self.input_batch.num_computed_tokens_cpu[:num_reqs].copy()
        self._dyntree_starts = num_scheduled_tokens[:num_reqs].cumsum() - num_scheduled_tokens[:num_reqs]
        step = plan_step(self, scheduler_output, num_scheduled_tokens, proposer)
        if step is not None and "positions" not in ablations():
            rows = torch.cat([torch.arange(s, s + t.size) for s, t in zip(step.starts, step.batch.trees)])
            self.positions[rows.to(self.positions.device)] = step.batch.positions(step.prefix).to(self.positions)
        _STEP = step
        # a forward of decoding rows only (no prefill chunk) refines the controller's cost model
        drafts = scheduler_output.scheduled_spec_decode_tokens
        decoding = all(int(num_scheduled_tokens[i]) == 1 + len(drafts.get(rid, ()))
                       for i, rid in enumerate(self.input_batch.req_ids[:num_reqs]))
        self._dyntree_forward = (time.perf_counter(), int(num_scheduled_tokens[:num_reqs].sum()) if decoding else 0)
        return out

    return wrapper


def _sample(orig: Any) -> Any:
    def wrapper(self: Any, logits: torch.Tensor | None, spec_decode_metadata: Any) -> Any:
        step, proposer = _STEP, _proposer(self)
        started, tokens = getattr(self, "_dyntree_forward", (0.0, 0))
        tree_ms = step.derived.get("tree_ms", 0.0) if step is not None else 0.0
        if proposer is not None and proposer.speculator is not None and tokens:
            # the target's own forward; the tree-attention pass is priced as a cost of speculating
            proposer.speculator.observe_forward(tokens, (time.perf_counter() - started) * 1e3 - tree_ms)
        out = orig(self, logits, spec_decode_metadata)
        if step is None or spec_decode_metadata is None or logits is None or proposer is None:
            return out
        assert proposer.speculator is not None
        ends = spec_decode_metadata.cu_num_sampled_tokens.tolist()
        flat = torch.cat([torch.arange(ends[i] - t.size, ends[i]) for i, t in zip(step.rows, step.batch.trees)])
        step.accept = res = proposer.speculator.accept(step.batch, logits[flat.to(logits.device)], proposer.generator,
                                                       overhead_ms=tree_ms)
        sampled = out.sampled_token_ids
        for b, i in enumerate(step.rows):
            sampled[i].fill_(-1)
            sampled[i, : len(res.tokens[b])] = torch.tensor(res.tokens[b], dtype=sampled.dtype)
        if "compaction" not in ablations():
            _compact(self, step, res)
        return out

    return wrapper


def _compact(runner: Any, step: TreeStep, res: AcceptResult) -> None:
    """Move each request's accepted nodes to the positions right after its prefix, every layer
    (indices computed once per cache layout, then one gather and one scatter per layer)."""
    block_tables = runner.input_batch.block_table[0].block_table.cpu
    moves = [(i, step.prefix[b], torch.tensor(res.accepted(b))) for b, i in enumerate(step.rows)]
    moves = [(i, base, nodes) for i, base, nodes in moves if not torch.equal(nodes, torch.arange(len(nodes)))]
    if not moves:
        return
    plans: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in runner.compilation_config.static_forward_context.values():
        isa = getattr(layer, "isa", None)
        kv = getattr(layer, "kv_cache", None)
        if isinstance(kv, (list, tuple)):
            kv = kv[0] if kv else None
        if isa is None or not isinstance(kv, torch.Tensor) or kv.numel() == 0:
            continue
        layout = KVLayout.of(kv, isa)
        if id(layout) not in plans:
            src, dst = [], []
            for i, base, nodes in moves:
                src.extend(layout.index(block_tables[i], base + nodes))
                dst.extend(layout.index(block_tables[i], base + torch.arange(len(nodes))))
            plans[id(layout)] = (torch.cat(src).reshape(-1), torch.cat(dst).reshape(-1))
        src_index, dst_index = plans[id(layout)]
        flat = kv.view(-1)
        flat[dst_index] = flat[src_index]  # every source is read before any write


def _propose_draft_token_ids(orig: Any) -> Any:
    def wrapper(self: Any, scheduler_output: Any, sampled_token_ids: Any, sampling_metadata: Any,
                hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        proposer = _proposer(self)
        if proposer is not None and proposer.speculator is not None:
            num_reqs = self.input_batch.num_reqs
            proposer.req_ids = list(self.input_batch.req_ids[:num_reqs])
            proposer.params = {rid: _params(self.requests[rid].sampling_params) for rid in proposer.req_ids}
            if proposer.speculator.needs_hidden:
                _push_hidden(self, scheduler_output, hidden_states, proposer)
        return orig(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states, *args, **kwargs)

    return wrapper


def _push_hidden(runner: Any, scheduler_output: Any, hidden: torch.Tensor, proposer: DynTreeProposer) -> None:
    """Hand the drafter the last-layer states of every position this step committed: all rows of a
    prefill chunk or plain decode, the accepted nodes of a tree."""
    assert proposer.speculator is not None
    step = _STEP
    tree_of = {i: b for b, i in enumerate(step.rows)} if step is not None and step.accept is not None else {}
    for i, rid in enumerate(proposer.req_ids):
        n = int(scheduler_output.num_scheduled_tokens.get(rid, 0))
        if n == 0:
            continue
        start = int(runner._dyntree_starts[i])
        if i in tree_of:
            assert step is not None and step.accept is not None
            rows = start + torch.tensor(step.accept.accepted(tree_of[i]))
        else:
            rows = torch.arange(start, start + n)
        proposer.speculator.observe_hidden(rid, hidden[rows.to(hidden.device)], start=int(runner._dyntree_computed[i]))


def _params(sp: Any) -> SamplingParams | None:
    """The request's sampling as the speculator's params, or ``None`` when it must decode plainly
    (whatever the tree verifier does not reproduce: penalties, logit bias, allowed or bad words,
    min-p, min-tokens, structured output, logprobs)."""
    if sp is None:
        return None
    plain = (
        sp.presence_penalty != 0 or sp.frequency_penalty != 0 or sp.repetition_penalty != 1 or sp.min_p != 0
        or sp.min_tokens or sp.logit_bias or sp.allowed_token_ids or sp.bad_words or sp.structured_outputs
        or sp.logprobs is not None or sp.prompt_logprobs is not None
    )
    if plain:
        return None
    greedy = sp.temperature < 1e-5
    return SamplingParams(temperature=0.0 if greedy else sp.temperature, top_k=max(sp.top_k, 0),
                          top_p=sp.top_p)


_PATCHES = {"_prepare_inputs": _prepare_inputs, "_sample": _sample, "propose_draft_token_ids": _propose_draft_token_ids}


def install(runner_cls: type) -> None:
    """Wrap the runner methods once (idempotent); raises if vLLM moved one of them."""
    if getattr(runner_cls, "_dyntree_patched", False):
        return
    for name, wrap in _PATCHES.items():
        orig = getattr(runner_cls, name, None)
        if orig is None:
            raise RuntimeError(f"dyntree: vLLM's {runner_cls.__name__}.{name} is gone; this vLLM is not supported")
        setattr(runner_cls, name, wrap(orig))
    runner_cls._dyntree_patched = True
