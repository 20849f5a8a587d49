"""The speculation step every engine calls: :class:`Speculator`.

An engine owns its model, KV cache and scheduling; the speculator owns everything else. Per step::

    batch = speculator.propose([SpecRequest(rid, token_ids, params), ...])   # plan, draft, build
    # engine: ONE target forward over batch.tokens at batch.positions(kv_lens), tree mask from
    #         batch.tree_bits (or batch.padded().mask), each request's committed prefix visible
    result = speculator.accept(batch, logits, generator, forward_ms)          # verify, learn
    # engine: keep the KV of result.accept_index (compaction), commit result.tokens, and push the
    #         accepted nodes' last-layer hidden states if speculator.needs_hidden:
    speculator.observe_hidden(rid, hidden[batch.flat_index(b, result.accepted(b))])

and ``release(rid)`` when a request ends. Inside: the adaptive controller's plan (per request
budgets, or plain decoding), the drafter's own trees or the :class:`~dyntree.common.builder.TreeBuilder`
over its top-k ``expand`` (one batched call per depth), budget checks, greedy or lossless sampling
verification, and the feedback to the drafter, the builder's calibration and the controller
(acceptance, measured forward and drafting time). :attr:`Speculator.stats` holds per-request and
per-depth counts and the time spent.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import torch

from dyntree.common.builder import BuiltTree, PartialTree, TreeBuilder
from dyntree.common.calibration import Calibrator
from dyntree.common.config import SamplingParams, SpecConfig
from dyntree.common.controller import Plan, SpeculationController
from dyntree.common.cost_model import CostModel
from dyntree.common.drafter import Candidates, DraftRequest, Drafter
from dyntree.common.options import TreeMode
from dyntree.common.sampling import process_logits, sample_verify
from dyntree.common.tree import DraftBatch, DraftTree
from dyntree.common.verify import VerifyResult, argmax_rows, greedy_path, pack_paths

__all__ = ["SpecRequest", "AcceptResult", "RequestStats", "SpecStats", "Speculator"]

GREEDY = SamplingParams()


@dataclass(frozen=True)
class SpecRequest:
    """One live request as an engine hands it to :meth:`Speculator.propose`.

    Attributes:
        request_id: engine-unique, stable for the request's life.
        token_ids: every committed token (prompt + generated); the last is the tree root, the
            others are in the target's KV cache.
        params: how the request samples (greedy by default); the draft is shaped the same way.
        max_nodes: optional cap on this request's draft nodes this step (e.g. the engine's free
            KV slots); never raises the configured budget.
        remaining: the tokens the request may still commit (its token limit less what it has
            generated), when the engine knows: its drafts go at most ``remaining - 1`` deep (the
            bonus token is the last), and with nothing waiting the request with the most left
            sets the batch's pace (``ControllerOptions.objective``).
    """

    request_id: Hashable
    token_ids: Sequence[int]
    params: SamplingParams = GREEDY
    max_nodes: int | None = None
    remaining: int | None = None


@dataclass(frozen=True)
class AcceptResult:
    """Verification of one :class:`~dyntree.common.tree.DraftBatch`.

    Attributes:
        request_ids: batch order.
        accept_index: ``[B, T_max]`` int64 local node indices of each accepted path, root first,
            ``-1`` padded: the KV to keep, in the form the ``kv_compact_*`` kernels take.
        accept_len: ``[B]`` int64 path lengths including the root.
        tokens: per request, the tokens to commit: accepted drafts, then the bonus token.
    """

    request_ids: list[Hashable]
    accept_index: torch.Tensor
    accept_len: torch.Tensor
    tokens: list[list[int]]

    @property
    def bonus(self) -> list[int]:
        """Per request, the target's own token after the accepted path (the last to commit)."""
        return [t[-1] for t in self.tokens]

    def accepted(self, b: int) -> list[int]:
        """Request ``b``'s accepted local node indices, root first."""
        return self.accept_index[b, : int(self.accept_len[b])].tolist()

    def result(self, b: int) -> VerifyResult:
        return VerifyResult(self.accepted(b), self.tokens[b])


@dataclass
class RequestStats:
    """One request's speculation so far."""

    steps: int = 0
    proposed: int = 0  # draft nodes
    accepted: int = 0  # accepted draft tokens
    accepted_per_depth: list[int] = field(default_factory=list)  # index d-1: accepted at depth d

    @property
    def tau(self) -> float:
        """Tokens committed per verify step (accepted drafts + bonus), before any stop cut."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0


@dataclass
class SpecStats:
    """Totals since the last :meth:`reset`: steps, per-depth counts, and time (seconds)."""

    steps: int = 0
    proposed_per_depth: list[int] = field(default_factory=list)
    accepted_per_depth: list[int] = field(default_factory=list)
    draft_s: float = 0.0  # propose(): plan, drafter, builder
    expand_s: float = 0.0  # of draft_s: inside the drafter's expand / propose
    accept_s: float = 0.0  # accept(): verification and learning
    forward_s: float = 0.0  # the engine's verify forwards, as reported to accept()
    requests: dict[Hashable, RequestStats] = field(default_factory=dict)

    @property
    def build_s(self) -> float:
        """Planning and tree building: drafting time outside the drafter."""
        return self.draft_s - self.expand_s

    def reset(self) -> None:
        live = self.requests
        self.__init__()  # type: ignore[misc]
        self.requests = {rid: RequestStats() for rid in live}


def _add(counts: list[int], depth: int, n: int = 1) -> None:
    while len(counts) < depth:
        counts.append(0)
    counts[depth - 1] += n


class Speculator:
    """Plans, drafts, builds, verifies and learns; engines run the target forward around it.

    Args:
        drafter: the draft source (a self-draft must have its engine backend attached).
        spec: what to speculate with.
        vocab_size: the target's vocabulary (candidate ids are checked against it).
        cost_model: the adaptive controller's cost of one verify forward, or a function that
            measures it (called once, by :meth:`prepare`); required when ``spec.adaptive``.
        padded: the engine pads every tree of a batch to the widest (the controller prices a
            verify as ``batch x widest`` query tokens).
        rectangular_kv: the engine keeps one rectangular cache, so every verify row attends over
            the longest request's slots (the controller prices attention at the longest prefix,
            else at the mean).
    """

    def __init__(
        self,
        drafter: Drafter,
        spec: SpecConfig | None = None,
        *,
        vocab_size: int,
        cost_model: CostModel | Callable[[], CostModel] | None = None,
        padded: bool = False,
        rectangular_kv: bool = False,
    ) -> None:
        self.drafter = drafter
        self.spec = spec = spec or SpecConfig()
        self.vocab_size = vocab_size
        if spec.tree is not None and not drafter.drafts_with_builder:
            raise ValueError(
                f"SpecConfig.tree={spec.tree!r} needs a drafter with expand; drafter {drafter.name!r} has "
                "none (leave tree unset to use its own trees)"
            )
        if drafter.needs_self_draft and getattr(drafter, "backend", None) is None:
            raise ValueError(f"drafter {drafter.name!r} drafts with the target's own forward: attach the engine's "
                             "SelfDraftBackend before building the speculator")
        self.own_mode: TreeMode | None = None if drafter.has_own_trees else "beam"
        uses_builder = spec.tree is not None or self.own_mode is not None
        options = spec.tree_options
        self.builder = TreeBuilder(options, Calibrator(options.calibration, drafter.acceptance_table),
                                   drafter.candidates_per_node) if uses_builder else None
        # only dyntree trees are priced by the calibration: it learns from verified trees (and the
        # drafter computes its rows' entropies, the calibration's second feature) then alone
        self._calibrates = uses_builder and (spec.tree or self.own_mode) == "dyntree"
        self._cost = cost_model
        self._padded = padded
        self._rectangular_kv = rectangular_kv
        self.controller: SpeculationController | None = None
        if spec.adaptive and cost_model is None:
            raise ValueError("SpecConfig.adaptive needs a cost model (or a function that measures one)")
        self.stats = SpecStats()
        self._params: dict[Hashable, SamplingParams] = {}
        self._kv: int | None = None  # the last propose's cached tokens per verify row (the cost model's kv)
        self._draft_ms: tuple[int, int, float, int] | None = None  # the last propose: (depth, nodes, ms, drafting requests)
        # the last decoding step's report: (perf_counter, rows, whether it had drafts)
        self._reported: tuple[float, int, bool] | None = None

    @property
    def needs_hidden(self) -> bool:
        """Engines push the target's last-layer hidden states of committed tokens (observe_hidden)."""
        return self.drafter.needs_hidden

    def prepare(self) -> float:
        """Set up the adaptive controller (measuring the cost model if a function was given);
        returns the seconds it took. :meth:`propose` calls it; call it first to keep it out of timings."""
        if not self.spec.adaptive or self.controller is not None:
            return 0.0
        t = time.perf_counter()
        if not isinstance(self._cost, CostModel):
            assert self._cost is not None
            self._cost = self._cost()
        share = self.drafter.level_cost_share
        options = self.spec.controller_options(self.drafter.acceptance_prior,
                                               None if share is None else share * self._cost(1))
        self.controller = SpeculationController(self._cost, self.spec.budget, options, padded=self._padded)
        return time.perf_counter() - t

    # -- the step ------------------------------------------------------------------------------
    def propose(self, requests: Sequence[SpecRequest], generator: torch.Generator | None = None,
                waiting: int | None = None) -> DraftBatch:
        """One draft tree per request, flat: plan, draft or build, check budgets. ``generator``
        (CPU) draws the children of sampled requests' trees; ``waiting``: the requests the engine
        holds back for want of room in the batch, when it knows (0: a request that finishes early
        frees a place nobody takes, so the controller plans for the batch's pace)."""
        if not requests:
            raise ValueError("propose needs at least one request")
        if len({r.request_id for r in requests}) != len(requests):
            raise ValueError("propose: request ids must be unique")
        self.prepare()
        t0 = time.perf_counter()
        expand_s = 0.0
        ids = [r.request_id for r in requests]
        kv_lens = [len(r.token_ids) - 1 for r in requests]
        # the cached tokens a verify row attends to: a rectangular cache's longest prefix, else the mean
        self._kv = self._attended(kv_lens)
        plans = None
        if self.controller is not None:
            full = [self._draft_request(r, None) for r in requests]
            can, evidence = self._foresight(full)
            plans = self.controller.plan(ids, self._kv, can, self.drafter.catch_up(full),
                                         [r.remaining for r in requests], waiting, evidence)
        drafts = [self._draft_request(r, plans[i] if plans else None) for i, r in enumerate(requests)]
        # a chain planned for a drafter that grows its own trees (no builder): its tree within the
        # full node budget, then the likeliest path (the plan priced a chain, not a branching tree)
        own_chains = set() if plans is None or self.builder is not None else {
            i for i, p in enumerate(plans) if p.mode == "chain"}
        built_trees: dict[int, DraftTree] = {}
        # one builder run per tree mode and draft shaping (greedy, or temperature / top-k / top-p)
        groups: dict[tuple[TreeMode | None, tuple[float, int, float] | None], list[int]] = {}
        for i, d in enumerate(drafts):
            if d.max_nodes > 0 and d.max_depth > 0:
                mode = "chain" if plans is not None and plans[i].mode == "chain" and self.builder else self.spec.tree
                p = requests[i].params
                groups.setdefault((mode or self.own_mode, None if p.greedy else (p.temperature, p.top_k, p.top_p)), []).append(i)
        for (mode, _), rows in groups.items():
            reqs = [drafts[i] for i in rows]
            if mode is None:
                t = time.perf_counter()
                wide = [dataclasses.replace(d, max_nodes=self._draft_request(requests[i], None).max_nodes)
                        if i in own_chains else d for i, d in zip(rows, reqs)]
                built = self.drafter.propose(wide)
                expand_s += time.perf_counter() - t
            else:
                built, spent = self._build(reqs, mode, requests[rows[0]].params, generator)
                expand_s += spent
            if len(built) != len(reqs):
                raise RuntimeError(f"drafter {self.drafter.name!r} returned {len(built)} trees for {len(reqs)} requests")
            built_trees.update((i, tree.best_chain() if i in own_chains else tree) for i, tree in zip(rows, built))
        trees = [built_trees[i] if i in built_trees else DraftTree.root_only(d.root) for i, d in enumerate(drafts)]
        for d, tree in zip(drafts, trees):
            if tree.root != d.root or (tree.size > 1 and (tree.size - 1 > d.max_nodes or tree.max_depth > d.max_depth)):
                raise RuntimeError(
                    f"drafter {self.drafter.name!r} broke its budget or root: root {tree.root} (want {d.root}), "
                    f"{tree.size - 1} nodes (max {d.max_nodes}), depth {tree.max_depth} (max {d.max_depth})"
                )
        batch = DraftBatch.from_trees(ids, trees)
        for r in requests:
            self._params[r.request_id] = r.params
        # a request's catch-up (its first draft, or a resume) is priced per position, not per
        # draft: its part per position leaves the drafting sample, its fixed part (the drafter's
        # layer runs on every drafting step) stays in it
        catch_ms, caught = self.drafter.pop_catch_up()
        if caught and self.controller is not None:
            self.controller.observe_catch_up(caught, catch_ms)
            catch_ms = min(catch_ms, self.controller.catch_ms * caught)
        spent_ms = (time.perf_counter() - t0) * 1e3
        drafting = sum(t.size > 1 for t in trees)
        # priced at accept
        self._draft_ms = (int(batch.depths.max()), batch.num_drafts, max(spent_ms - catch_ms, 0.0), drafting)
        self.stats.draft_s += spent_ms / 1e3  # the statistics keep all of it
        self.stats.expand_s += expand_s
        return batch

    def accept(
        self,
        batch: DraftBatch,
        target: torch.Tensor,
        generator: torch.Generator | None = None,
        forward_ms: float | None = None,
        overhead_ms: float = 0.0,
    ) -> AcceptResult:
        """Verify ``batch`` against the target and learn from the outcome.

        Args:
            batch: this step's :meth:`propose` result.
            target: ``[N, V]`` target logits, one row per flat node (the distribution of the token
                after it), or ``[N]`` target argmax (greedy requests only); for a batch of
                root-only trees (nobody drafted: a step of plain decoding), ``[N]`` may also be
                the tokens the engine's own sampler drew from the target's distribution.
            generator: random source of sampled requests (CPU).
            forward_ms: the engine's measured verify forward (refines the controller's cost model).
            overhead_ms: time the trees cost the engine outside the target's own forward (e.g. a
                tree-attention pass beside the engine's kernel for branching trees); with branching
                trees in ``batch`` the controller prices it per branching tree
                (``observe_branching``), else with the drafting time.
        """
        t0 = time.perf_counter()
        # a plan that drafted nothing: its cost (propose and this accept) is what planning costs
        planned_ms = self._draft_ms[2] if self._draft_ms is not None and batch.num_drafts == 0 else None
        if forward_ms is None:  # not a step of decoding rows alone: the next step's cycle is not measured
            self._reported = None
        else:
            self._cycle(t0, batch.batch_size, forward_ms + overhead_ms + (self._draft_ms[2] if self._draft_ms else 0.0),
                        batch.num_drafts > 0)
        result = self._verify(batch, target, [self._params[rid] for rid in batch.request_ids], generator)
        self._learn(batch, result, forward_ms, overhead_ms)
        spent = time.perf_counter() - t0
        self.stats.accept_s += spent
        if planned_ms is not None and self.controller is not None:
            self.controller.observe_plan_cost(batch.batch_size, planned_ms + spent * 1e3, planned_ms)
        return result

    def first_tokens(self, requests: Sequence[SpecRequest], target: torch.Tensor,
                     generator: torch.Generator | None = None) -> list[int]:
        """The token after each request's last one, from the target's ``[B, V]`` logits at that
        position (``[B]`` argmax for greedy requests): what verifying a root-only tree picks. For
        an engine whose prefill also runs the prompt's last token; nothing is counted or learned
        (the first verify step still starts from :meth:`propose`)."""
        trees = [DraftTree.root_only(r.token_ids[-1]) for r in requests]
        batch = DraftBatch.from_trees([r.request_id for r in requests], trees)
        return [toks[0] for toks in self._verify(batch, target, [r.params for r in requests], generator).tokens]

    def _verify(self, batch: DraftBatch, target: torch.Tensor, params: list[SamplingParams],
                generator: torch.Generator | None) -> AcceptResult:
        n = batch.num_nodes
        if target.shape[0] != n or target.dim() not in (1, 2):
            raise ValueError(f"accept: target must be [{n}, V] logits or [{n}] argmax, got {tuple(target.shape)}")
        argmax = target if target.dim() == 1 else argmax_rows(target)
        if n == batch.batch_size and (target.dim() == 1 or all(p.greedy for p in params)):
            # root-only trees: plain decoding (greedy, or the engine sampled each next token itself)
            return AcceptResult(list(batch.request_ids), torch.zeros(n, 1, dtype=torch.int64),
                                torch.ones(n, dtype=torch.int64), [[t] for t in argmax.tolist()])
        # greedy trees walked on host lists, segment by segment (no padded copy of the batch)
        toks, pars, top = batch.tokens.tolist(), batch.parents.tolist(), argmax.tolist()
        ptr = batch.qo_indptr.tolist()
        paths: list[list[int]] = []
        tokens: list[list[int]] = []
        for b, (tree, p) in enumerate(zip(batch.trees, params)):
            lo, hi = ptr[b], ptr[b + 1]
            if p.greedy:
                path = greedy_path(toks[lo:hi], pars[lo:hi], top[lo:hi])
                paths.append(path)
                tokens.append([toks[lo + i] for i in path[1:]] + [top[lo + path[-1]]])
                continue
            if target.dim() != 2:
                raise ValueError(f"accept: request {batch.request_ids[b]!r} samples; pass logits, not argmax")
            probs = process_logits(target[lo:hi].float().cpu(), p.temperature, p.top_k, p.top_p)
            res = sample_verify(tree, probs, generator, self.spec.tree_options.sampling_scheme)
            paths.append(list(res.accepted_nodes))
            tokens.append(res.tokens)
        index, length = pack_paths(paths, max(t.size for t in batch.trees))
        return AcceptResult(list(batch.request_ids), index, length, tokens)

    def quiet(self, request_ids: Sequence[Hashable], requests: Callable[[], Sequence[SpecRequest]]) -> bool:
        """Whether this step may go without :meth:`propose` and :meth:`accept`: the adaptive
        controller's recent plans for this same batch could not pay whatever the drafter found,
        and what the drafter knows now (its evidence: a longer n-gram match) promises no better
        (:meth:`~dyntree.common.controller.SpeculationController.quiet`); or the drafter knows
        beforehand that it has nothing for any of the requests (:attr:`Drafter.knows_availability`:
        an n-gram lookup without a match for every one), so there is no plan to make
        (:meth:`~dyntree.common.controller.SpeculationController.idle`). The engine then decodes
        every request plainly, keeps pushing hidden states (:meth:`observe_hidden`) and reports
        the forward to :meth:`observe_forward`. ``requests()`` builds the step's requests (in
        ``request_ids``' order) for the drafter to be asked; it is called only when the drafter is
        asked."""
        if self.controller is None:
            return False
        foresight = ((lambda: self._foresight([self._draft_request(r, None) for r in requests()]))
                     if self.drafter.has_evidence else None)
        if self.controller.quiet(request_ids, foresight):
            return True
        if not self.drafter.knows_availability:
            return False
        reqs = requests()
        can, evidence = self._foresight([self._draft_request(r, None) for r in reqs])
        if can is None or any(can):
            return False
        self.controller.idle(request_ids, self._attended([len(r.token_ids) - 1 for r in reqs]), evidence)
        return True

    def _foresight(self, full: Sequence[DraftRequest]) -> tuple[list[bool] | None, list[int] | None]:
        """What the drafter knows before drafting ``full`` (requests at the full budget): which it
        can draft for (``None``: unknown; a request with one token left cannot) and each one's
        evidence class (``None``: it knows none)."""
        can = self.drafter.can_draft(full)
        if any(d.max_depth == 0 for d in full):  # a request with one token left has nothing to draft
            can = [d.max_depth > 0 and (can is None or c) for d, c in zip(full, can or [True] * len(full))]
        return can, self.drafter.evidence(full)

    def observe_forward(self, n_query_tokens: int, ms: float, kv_lens: Sequence[int] | None = None) -> None:
        """A measured target forward the engine did not report to :meth:`accept`: a plain decoding
        step, or a verify whose batch also held rows outside the trees (``n_query_tokens`` counts
        every query token of the forward, ``kv_lens`` each of its requests' cached tokens, when
        known: the cost model learns it at its batch size and attention, as :meth:`propose` prices
        them). Refines the adaptive controller's cost model; an engine reports each forward either
        here or through ``accept(forward_ms=...)``, not both."""
        if self.controller is not None and n_query_tokens > 0 and ms > 0:
            kv = self._attended(kv_lens) if kv_lens else None
            self.controller.observe_step(n_query_tokens, ms, kv, len(kv_lens) if kv_lens else 1)
            if kv_lens:  # the step's requests known: its cycle is measured against a step of as many
                self._cycle(time.perf_counter(), len(kv_lens), ms, False)

    def _cycle(self, now: float, rows: int, measured_ms: float, drafted: bool) -> None:
        """A decoding step of ``rows`` requests reported at ``now`` whose forward and drafting
        took ``measured_ms``: the rest of the time since the previous step's report (a step of as
        many rows) is the engine's between forwards (``observe_cycle``), that of a step with
        drafts when this step (``drafted``) or the previous one had some: the span holds this
        step's input preparation and the previous step's verification and bookkeeping. A gap
        that holds a step not reported (a prefill chunk), or the engine idle between requests, is
        left out: it leaves more than half of the step unaccounted for."""
        last, self._reported = self._reported, (now, rows, drafted)
        if self.controller is None or last is None or last[1] != rows:
            return
        between = (now - last[0]) * 1e3 - measured_ms
        if 0 <= between <= measured_ms / 2:
            self.controller.observe_cycle(rows, between, drafted or last[2])

    def observe_hidden(self, request_id: Hashable, states: torch.Tensor, start: int | None = None) -> None:
        """The target's last-layer hidden states ``[n, d]`` (the LM-head input) of the request's
        next ``n`` committed positions, in order: after the prefill the prompt tokens it cached
        (all of them when it also gave the first token), then after each step the accepted nodes'
        (root first; not the bonus): every position before the next tree's root. ``start``:
        the position of the first row, when the engine skipped some (a prefix-cache hit); drafters
        that need every position refuse a gap. Ignored unless :attr:`needs_hidden`."""
        if self.drafter.needs_hidden:
            self.drafter.observe_hidden(request_id, states, start)

    def observe_hidden_rows(self, request_ids: Sequence[Hashable], states: torch.Tensor,
                            starts: Sequence[int | None]) -> None:
        """:meth:`observe_hidden` of a plain decoding step, one call for the batch: row ``i`` of
        ``states`` ``[len(request_ids), d]`` is the one position request ``request_ids[i]``
        committed, at position ``starts[i]`` (``None``: not said)."""
        if self.drafter.needs_hidden:
            self.drafter.observe_hidden_rows(request_ids, states, starts)

    def release(self, request_id: Hashable) -> RequestStats:
        """The request ended: drop its state everywhere; returns its statistics."""
        self.drafter.release(request_id)
        if self.controller is not None:
            self.controller.release(request_id)
        self._params.pop(request_id, None)
        return self.stats.requests.pop(request_id, RequestStats())

    # -- inside the step -----------------------------------------------------------------------
    def _attended(self, kv_lens: Sequence[int]) -> int:
        """The cached tokens a verify row attends to, as the cost model prices them: a rectangular
        cache's longest prefix, else the mean."""
        return max(kv_lens) if self._rectangular_kv else round(sum(kv_lens) / len(kv_lens))

    def _draft_request(self, r: SpecRequest, plan: Plan | None) -> DraftRequest:
        nodes = plan.max_nodes if plan is not None else self.spec.max_nodes
        depth = plan.max_depth if plan is not None else self.spec.max_depth
        if r.max_nodes is not None:
            nodes = min(nodes, max(r.max_nodes, 0))
        if self.drafter.max_depth is not None:
            depth = min(depth, self.drafter.max_depth)
        if r.remaining is not None:  # drafts past the request's last token would be cut
            depth = min(depth, max(r.remaining - 1, 0))
        if len(r.token_ids) == 0:
            raise ValueError(f"request {r.request_id!r} has no tokens (the last committed token is the root)")
        return DraftRequest(r.request_id, r.token_ids, nodes, depth)

    def _build(
        self, reqs: list[DraftRequest], mode: TreeMode, params: SamplingParams, gen: torch.Generator | None
    ) -> tuple[list[DraftTree], float]:
        """Grow ``reqs``' trees in ``mode``; returns them and the seconds spent in the drafter."""
        assert self.builder is not None
        shaping = None if params.greedy else params
        spent = 0.0

        def expand(frontiers: list[list[int]], partials: list[PartialTree], k: int) -> list[Candidates]:
            nonlocal spent
            t = time.perf_counter()
            cands = self.drafter.expand(reqs, frontiers, partials, k, shaping, entropy=self._calibrates)
            spent += time.perf_counter() - t
            return cands.split([len(f) for f in frontiers])

        built = self.builder.build_batch(
            [r.root for r in reqs], expand, budgets=[(r.max_nodes, r.max_depth) for r in reqs], mode=mode,
            sampling=not params.greedy, generator=gen, vocab_size=self.vocab_size,
            beam=(self.drafter.beam_width, self.drafter.beam_topk),
        )  # fmt: skip
        return list(built), spent

    def _learn(self, batch: DraftBatch, result: AcceptResult, forward_ms: float | None, overhead_ms: float) -> None:
        """Feed the outcome to the drafter, the builder's calibration, the controller and the stats."""
        st = self.stats
        if self.controller is not None and self._draft_ms is not None:
            depth, nodes, draft_ms, drafting = self._draft_ms
            # a tree is branching when it has more draft nodes than levels (max_depth: a tensor op,
            # so counted only when the engine reports extra time or the outcome is checked)
            counted = overhead_ms > 0 or forward_ms is not None
            built = sum(t.size > 2 and t.size - 1 > t.max_depth for t in batch.trees) if counted else 0
            branching = built if overhead_ms > 0 else 0
            if branching:  # the engine's extra time for branching trees
                self.controller.observe_branching(branching, overhead_ms)
                self.controller.observe_draft(depth, nodes, draft_ms, drafting)
            else:
                self.controller.observe_draft(depth, nodes, draft_ms + overhead_ms, drafting)
            if forward_ms is not None:
                self.controller.observe_outcome(sum(len(t) for t in result.tokens), forward_ms + draft_ms + overhead_ms,
                                                branching=built > 0)
        self._draft_ms = None
        st.steps += 1
        plain = batch.num_drafts == 0  # root-only trees: each accepted its root
        for b, (rid, tree) in enumerate(zip(batch.request_ids, batch.trees)):
            nodes = [0] if plain else result.accepted(b)
            self.drafter.observe(rid, result.tokens[b], len(nodes) - 1)
            if self.builder is not None and self._calibrates and isinstance(tree, BuiltTree) and tree.size > 1:
                self.builder.observe(tree, nodes)
            if self.controller is not None:
                self.controller.observe(rid, tree, nodes)
            rs = st.requests.setdefault(rid, RequestStats())
            rs.steps += 1
            rs.proposed += tree.size - 1
            rs.accepted += len(nodes) - 1
            for d in tree.depths[1:].tolist() if tree.size > 1 else ():
                _add(st.proposed_per_depth, d)
            for d in range(1, len(nodes)):
                _add(rs.accepted_per_depth, d)
                _add(st.accepted_per_depth, d)
        if self.controller is not None and forward_ms is not None and forward_ms > 0:
            width = max(t.size for t in batch.trees)
            n_query = batch.batch_size * width if self._padded else batch.num_nodes
            self.controller.observe_step(n_query, forward_ms, self._kv, batch.batch_size)
        if forward_ms is not None:
            st.forward_s += forward_ms / 1e3
