"""Tree verification inside vLLM's V1 model runner: four runner hooks.

vLLM schedules each request's draft nodes (root first) as an ordinary run of query tokens with
linear KV slots. Each step the hooks build one explicit
:class:`~dyntree.vllm_plugin.step.StepRecord` (with its
:class:`~dyntree.vllm_plugin.step.TreeStep`) and hand it on by argument:

* ``_prepare_inputs`` (after vLLM's own, which builds plain decoding's inputs for a step without
  drafts rather than spec-decode metadata of zero drafts): the proposer opens the step
  (:meth:`~dyntree.vllm_plugin.proposer.DynTreeProposer.begin_step`, with each request's sampling
  and token limit, and the scheduler's count of waiting requests); tree rows get RoPE positions
  ``prefix + depth`` (slots stay linear); the tree attention builders
  (:class:`~dyntree.vllm_plugin.step.TreeAttentionBuilder`: the CPU one, or the Triton one on CUDA) are
  given the :class:`~dyntree.vllm_plugin.step.TreeStep` to plan into the step's attention metadata,
  which reaches every layer through vLLM's forward context;
* ``_sample``: the speculator verifies the trees (greedy or lossless sampling) on the unmodified
  logits; every decoding request it drafted for carries one (root-only when it drafted nothing),
  so a step of decoding rows is verified whole and its time and tokens reach the adaptive
  controller's outcome check, as in the standalone engine; vLLM's own sampler serves the rest
  (prefill chunks, requests that do not speculate) and is skipped when nothing is left. A step in
  which nobody drafted is plain decoding: vLLM's sampler draws it, and its tokens are reported to
  the speculator as the root-only trees' outcome. The accepted path plus bonus replaces the request's row of
  ``sampled_token_ids`` (``-1`` padded, so the scheduler rolls back exactly the rejected slots),
  and the accepted nodes' KV moves to positions ``prefix .. prefix + len - 1`` (compaction, by
  each builder over its own cache layout; a depth-first tree whose accepted path is its
  first-child chain moves nothing);
* ``propose_draft_token_ids`` (before vLLM's own): drafters that read hidden states get the
  committed tokens' states, then vLLM calls the proposer, which reads the batch from the record;
* ``sample_tokens`` (after vLLM's own): the step's drafts go back on its output
  (:mod:`dyntree.vllm_plugin.inline_drafts`), so the engine core need not ask for them.

``DYNTREE_VLLM_ABLATE`` (``mask``, ``positions``, ``compaction``, ``lead``: a step of branching
trees only skips vLLM's kernel but leaves the trees' leading chains uncomputed; comma separated)
switches one piece off: a test control whose outputs must then differ from plain decoding.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from dyntree.common.verify import pack_paths
from dyntree.vllm_plugin.inline_drafts import attach
from dyntree.vllm_plugin.scheduler import waiting
from dyntree.vllm_plugin.step import StepRecord, TreeStep, ablations, layer_caches, plan_trees, tree_builders

if TYPE_CHECKING:
    from dyntree.vllm_plugin.proposer import DynTreeProposer

__all__ = ["install"]


def _proposer(runner: Any) -> "DynTreeProposer | None":
    """The runner's dyntree drafter (``None`` for a runner without one: another engine in this process)."""
    from dyntree.vllm_plugin.proposer import DynTreeProposer

    drafter = getattr(runner, "drafter", None)
    return drafter if isinstance(drafter, DynTreeProposer) and drafter.speculator is not None else None


def _prepare_inputs(orig: Any) -> Any:
    def wrapper(self: Any, scheduler_output: Any, num_scheduled_tokens: Any) -> Any:
        proposer = _proposer(self)
        if proposer is None:
            return orig(self, scheduler_output, num_scheduled_tokens)
        proposer.bind(self)
        if any(scheduler_output.scheduled_spec_decode_tokens.values()):
            out = orig(self, scheduler_output, num_scheduled_tokens)
        else:  # no drafts this step: vLLM's plain-decoding inputs, not spec-decode metadata of zero drafts
            spec, self.speculative_config = self.speculative_config, None
            try:
                out = orig(self, scheduler_output, num_scheduled_tokens)
            finally:
                self.speculative_config = spec
        builders = tree_builders(self)
        num_reqs = self.input_batch.num_reqs
        req_ids = list(self.input_batch.req_ids[:num_reqs])
        computed = self.input_batch.num_computed_tokens_cpu[:num_reqs].copy()
        ended = list(scheduler_output.finished_req_ids) + [rid for rid, c in zip(req_ids, computed) if c == 0]
        for rid in ended:  # finished, or new / recomputed after preemption
            proposer.release(rid)
            for builder in builders:
                builder.release(rid)
        scheduled = num_scheduled_tokens[:num_reqs]
        drafts = scheduler_output.scheduled_spec_decode_tokens
        tree = plan_trees(req_ids, drafts, scheduled, computed, proposer.trees)
        if tree is not None and tree.batch.num_drafts and "positions" not in ablations():
            rows = torch.cat([torch.arange(s, s + t.size) for s, t in zip(tree.starts, tree.batch.trees)])
            self.positions[rows.to(self.positions.device)] = tree.batch.positions(tree.prefix).to(self.positions)
        if not builders and tree is not None:
            raise RuntimeError("dyntree: vLLM did not build dyntree's tree attention backend for this model")
        for builder in builders:
            builder.plan_trees(tree)
        # a forward of decoding rows only (no prefill chunk) refines the controller's cost model
        decoding = all(int(scheduled[i]) == 1 + len(drafts.get(rid, ())) for i, rid in enumerate(req_ids))
        admitted = {rid: proposer.admit(rid, self.requests[rid]) for rid in req_ids}
        proposer.begin_step(StepRecord(
            req_ids, {rid: a[0] for rid, a in admitted.items()}, computed, scheduled.cumsum() - scheduled,
            scheduled.copy(), time.perf_counter(), int(scheduled.sum()) if decoding else 0, tree,
            {rid: a[1] for rid, a in admitted.items()}, waiting(scheduler_output)))
        return out

    return wrapper


def _sample(orig: Any) -> Any:
    def wrapper(self: Any, logits: torch.Tensor | None, spec_decode_metadata: Any) -> Any:
        from vllm.v1.outputs import SamplerOutput

        proposer = _proposer(self)
        step = proposer.step if proposer is not None else None
        tree = step.tree if step is not None else None
        if step is not None and logits is not None and logits.is_cuda:
            torch.cuda.synchronize(logits.device)  # the forward's time, not its launch's
        tree_ms = tree.attention_ms if tree is not None else 0.0
        whole = tree is not None and len(tree.rows) == len(step.req_ids)  # every row verified as a tree
        forward_ms = (time.perf_counter() - step.started) * 1e3 - tree_ms if step is not None else 0.0
        if proposer is not None and step is not None and step.decode_tokens and not whole:
            # a forward with rows outside the trees (or a quiet step's) refines the cost model only
            proposer.speculator.observe_forward(step.decode_tokens, forward_ms, step.computed.tolist())
        if tree is None or logits is None or proposer is None or (spec_decode_metadata is None and not whole):
            return orig(self, logits, spec_decode_metadata)
        if spec_decode_metadata is None:  # nobody drafted: a step of plain decoding, by vLLM's own sampler
            out = orig(self, logits, spec_decode_metadata)
            sampled = out.sampled_token_ids[torch.tensor(tree.rows, device=out.sampled_token_ids.device), 0]
            tree.accept = proposer.speculator.accept(tree.batch, sampled.cpu().to(torch.int64), proposer.generator,
                                                     forward_ms=forward_ms if step.decode_tokens else None)
            return out
        width = spec_decode_metadata.max_spec_len + 1
        # verified first: vLLM's sampler may scale the logits in place. A whole step of decoding
        # rows is reported as such: the controller checks its outcome, as the standalone engine's
        tree.accept = res = proposer.speculator.accept(
            tree.batch, _tree_logits(logits, tree, spec_decode_metadata), proposer.generator,
            forward_ms=forward_ms if whole and step.decode_tokens else None, overhead_ms=tree_ms)
        committed = _padded_rows(res.tokens, width)
        if whole:  # every row is a tree, in batch order (plan_trees): vLLM's sampler has nothing left to do
            out = SamplerOutput(committed.to(logits.device), None)
        else:
            out = orig(self, logits, spec_decode_metadata)
            out.sampled_token_ids[torch.tensor(tree.rows, device=logits.device)] = committed.to(out.sampled_token_ids)
        if tree.batch.num_drafts and "compaction" not in ablations():
            _compact(self, tree)
        return out

    return wrapper


def _tree_logits(logits: torch.Tensor, tree: TreeStep, spec_decode_metadata: Any) -> torch.Tensor:
    """The trees' logits rows, in the batch's flat node order: the last of each tree request's
    sampled rows (vLLM samples one row per scheduled token; host lists, as a step holds a few small
    trees). Rows that follow each other, as in a step of trees alone, are a view, not a copy of
    ``[N, vocab]`` logits (nothing writes them before the trees are verified)."""
    ends = spec_decode_metadata.cu_num_sampled_tokens.cpu().tolist()
    sizes = tree.batch.qo_indptr.diff().tolist()
    flat = [i for r, size in zip(tree.rows, sizes) for i in range(ends[r] - size, ends[r])]
    if flat[-1] - flat[0] + 1 == len(flat):  # increasing (rows in batch order), so one run
        return logits[flat[0] : flat[-1] + 1]
    return logits[torch.tensor(flat, device=logits.device)]


def _padded_rows(tokens: list[list[int]], width: int) -> torch.Tensor:
    """``[len(tokens), width]`` int32: each request's committed tokens, ``-1`` after them (vLLM's
    sampled rows: the scheduler rolls back the slots of rejected drafts)."""
    return pack_paths(tokens, width)[0].to(torch.int32)


def _compact(runner: Any, step: TreeStep) -> None:
    """Move each request's accepted nodes to the positions right after its prefix, in every layer
    (each tree attention builder over its own cache layout), and commit them in each builder."""
    moves = step.moves()
    caches = layer_caches(runner) if moves else {}
    block_table = runner.input_batch.block_table[0]
    for builder in tree_builders(runner):
        if moves:
            builder.compact(caches, block_table, moves)
        builder.commit(step)


def _propose_draft_token_ids(orig: Any) -> Any:
    def wrapper(self: Any, scheduler_output: Any, sampled_token_ids: Any, sampling_metadata: Any,
                hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        proposer = _proposer(self)
        if proposer is not None and proposer.step is not None and proposer.speculator.needs_hidden:
            _push_hidden(proposer.step, hidden_states, proposer)
        return orig(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states, *args, **kwargs)

    return wrapper


def _push_hidden(step: StepRecord, hidden: torch.Tensor, proposer: "DynTreeProposer") -> None:
    """Hand the drafter the last-layer states of every position this step committed: all rows of a
    prefill chunk or plain decode, the accepted nodes of a tree."""
    tree = step.tree
    drafted = tree is not None and tree.accept is not None and tree.batch.num_drafts > 0
    if not drafted and step.decode_tokens == len(step.req_ids):  # plain decoding: one row per request, in order
        proposer.speculator.observe_hidden_rows(step.req_ids, hidden[: len(step.req_ids)], step.computed.tolist())
        return
    tree_of = {i: b for b, i in enumerate(tree.rows)} if drafted else {}  # else: every row is a plain step's
    for i, rid in enumerate(step.req_ids):
        n = int(step.scheduled[i])
        if n == 0:
            continue
        start = int(step.starts[i])
        nodes = tree.accept.accepted(tree_of[i]) if i in tree_of else []  # type: ignore[union-attr]
        if len(nodes) > 1:  # an accepted path of the tree: those rows
            states = hidden[(start + torch.tensor(nodes)).to(hidden.device)]
        else:  # all rows (a root alone is its first row)
            states = hidden[start : start + (1 if nodes else n)]
        proposer.speculator.observe_hidden(rid, states, start=int(step.computed[i]))


def _sample_tokens(orig: Any) -> Any:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        if _proposer(self) is not None:
            attach(self, out)  # the drafts ride back with the output: no second RPC (inline_drafts)
        return out

    return wrapper


_PATCHES = {"_prepare_inputs": _prepare_inputs, "_sample": _sample, "propose_draft_token_ids": _propose_draft_token_ids,
            "sample_tokens": _sample_tokens}


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
