"""Adaptive speculation controller: how much to speculate, per request and per batch.

* Per request, an EMA of the top-1 draft acceptance ``alpha`` (the chance that the root's first
  child is accepted) and a global *sibling gain* ``g`` (what an extra
  sibling is worth relative to an independent first draft: 0 nothing, 1 as much) predict the
  expected accepted draft tokens of a tree with ``n`` nodes and depth ``d``: with ``w = n / d``
  nodes per level, level 1's acceptance is the request's ``alpha`` and a deeper level ``j``'s
  comes from the *level acceptance* ``a_j``: over every request that reached that level (on the
  accepted path), the chance that the node there has its first child accepted. Measured in vLLM
  it hardly moves with the request's own alpha (Hydra's level 2 went on 0.56-0.60 of the time for
  requests whose alpha read 0.28-0.58, n-gram's 0.44-0.70 for 0.14-0.40, ``docs/trees.md``), so
  a request's rate there is pooled: half ``a_j``, half ``a_j`` scaled by its alpha over the
  reaching requests' (a ratio to alpha alone priced a low-alpha request's deep nodes far below
  what they deliver and kept its plans at one node; the half that follows alpha keeps one request
  copying a passage from lending its deep levels whole to the others). Hydra's weaker later heads
  make its trees shallower, an n-gram match that held once makes them deeper;
  ``beta_j = 1 - (1 - alpha_j)^(1 + g (w - 1))``,
  ``E(n, d) = beta_1 + beta_1 beta_2 + ... + beta_1 ... beta_d``, times the request's *delivery* (the EMA fraction
  of planned nodes the drafter actually drafted: n-gram lookup often finds nothing; a drafter
  that can tell beforehand, ``Drafter.can_draft``, is planned only for the requests it can draft
  for, at its delivery among those steps); the best
  depth is chosen per ``n``; a verify is priced as wide as planned only with the chance that
  some planned tree arrives, else as plain decoding. ``g`` is fitted online from how often later
  siblings catch the token a first child missed. A request that keeps being accepted gets deep,
  large trees; one that keeps failing gets a short chain or nothing (each draft node must be
  worth ``min_node_value`` accepted tokens), and drifts back toward the prior (and full delivery)
  while idle so it is retried now and then. A request's own alpha starts at its population's
  worth ``prior_weight`` observations, and idle steps fade its evidence back to that weight as
  they move it, so a new request's or a retry's first steps decide (``docs/vllm.md``: a prior as
  firm as an EMA's whole history kept a batch drafting at a loss).
  A drafter that knows something before drafting that moves its acceptance
  (``Drafter.evidence``: the n-gram index's longest match, in classes of 1, 2-3, 4-7, ...
  tokens) has alpha kept per request and class, each class starting where it stands over every
  request: a request that starts copying a passage is planned by what copied passages
  are accepted at from its first such step, not after an EMA has climbed out of its last misses.
  A request's alpha also keeps its class's acceptance over finished requests beside its own EMA,
  at the weight those requests earn it (:class:`Dispersion`: how much they differed beyond
  chance): where requests hardly differ, as in the n-gram's one-token matches, a request's
  ten-step EMA is mostly scatter, and a few misses in a row would stop drafting that pays.
* Per batch, a :class:`CostModel` (ms of one target forward vs. its number of query tokens,
  piecewise linear, seeded from start-up timings and refined online) prices the verify forward.
  Every request's node increments, ordered by expected accepted tokens per added query token
  (the upper concave hull of its ``E``), are merged across the batch; the controller takes the
  prefix of that list that maximises predicted tokens per millisecond, and speculates only if
  that beats plain decoding by ``min_gain``. A ragged verify (vLLM, the standalone engine) pays
  for its roots plus its draft nodes; an engine that pads every tree of a batch to the widest one
  (SGLang's verify; ``padded=True``) pays ``batch x (1 + widest)`` query tokens, and the plan is
  priced that way, with attention over the cached tokens (the longest request's in an engine
  with one rectangular cache) as terms of their own: per query token and per request (each
  request's cache is read once, whatever its query tokens). Drafting is priced too: a :class:`DraftCost`
  (ms vs. tree depth and batch draft nodes, one per class of drafting requests: :class:`DraftCosts`)
  starts from the ``draft_ms_*`` options (the drafter's
  ``level_cost_share`` of a target forward per level, for a drafter that runs one) and is fitted
  online to the measured drafting time of each step (tree building included), so a drafter
  whose overhead eats the gain is turned down. Every step also pays the engine's time between
  forwards (:meth:`SpeculationController.observe_cycle`: its sampling, bookkeeping and input
  preparation), learned apart for steps with drafts, which prepare, verify and roll back more
  rows, and plain ones: a plan that drafts pays the first, plain decoding the second. A plan's
  measured drafting includes the planning itself, which a plan without drafts pays too
  (:meth:`SpeculationController.observe_plan_cost`'s ``planning_ms``), so plain decoding after a
  plan is priced with it: drafts are weighed by what they add to a step that planned. An engine
  that spends time per branching tree outside the target's forward (vLLM's CPU tree attention
  beside its own kernel; a chain needs none) reports it
  (:meth:`SpeculationController.observe_branching`): each branching tree of a plan is then
  priced with it, and a chains-only plan is weighed against the plan with trees.
  Only planned trees are timed, so after ``probe_steps`` plans without one the price drifts
  toward 0 until trees are planned and timed anew (an engine's first tree pays one-time costs).
  A drafter with state of its own to bring up to date before a request's draft (Hydra's prefix
  layer, at a request's first draft or when it resumes after idle steps) reports the positions
  per request (``Drafter.catch_up``) and what catching up cost
  (:meth:`SpeculationController.observe_catch_up`): a plan that drafts for such a request pays
  them at that step, at what a catch-up costs per position beyond the drafter's fixed cost of a
  step, which drafting already prices, spread over the steps the catch-up serves (the request's
  remaining tokens over 2, at most ``catch_up_steps`` over the batch size, times the share of
  the batch size's recent plans that drafted): it is paid once. Priced
  whole against one step's gain it kept requests that start or resume from drafting, and each
  quiet step added a position to catch up; a batch of several requests pays their catch-ups
  together while all of them wait, and speculates on fewer of its later steps (on a CPU, at 8-16
  requests, hardly any), so its horizon shrinks with the batch, and a catch-up at a batch size
  whose plans seldom draft (a probe's) serves about one step.
  When a forward's cost grows in proportion to its
  tokens (compute-bound, high batch) no prefix pays and every request decodes plainly.
* The objective (``ControllerOptions.objective``): committed tokens per ms while requests wait
  for a place in the batch (a request that finishes early makes room for one), else the batch's
  pace. With nothing waiting the batch lasts as long as the request that finishes last, so a
  plan is worth ``batch x min(slack x (1 + E))`` per ms (``slack``: the most tokens left in the
  batch over the request's own, 1 for the request that sets the pace) and hull steps are merged
  by water-filling, the lowest request's next step first: drafts for some requests while the
  others (an n-gram drafter without a match) cannot keep up only make every step dearer.
* Quiet spells: before searching, a bound (every request's best tree at the cheapest forward's cost,
  plus the least drafting and catch-up a paying plan needs) says whether any plan could pay.
  When no plan pays though the drafter could draft for every request (or none could by the
  bound if it could), the same batch (or what is left of it as requests finish, at the same
  batch size) may decode the next steps without a plan
  (:meth:`SpeculationController.quiet`; 1, 2, 4, ... steps up to ``quiet_steps``, or up to 64 where a
  plan costs more than ``quiet_share`` of the spell's plain steps), so an engine
  skips drafting and verification there too. A batch held back by requests the drafter has
  nothing for this step (an n-gram lookup without a match) goes quiet the same way once its
  plans, at that batch size, save fewer milliseconds (an EMA) than the plans without drafts cost
  the engine as often as they come (:meth:`SpeculationController.observe_plan_cost`): at batch 1
  a match often comes next step and pays, in a batch of 16 all matching at once is rare.
* Probes: a batch size that has not speculated for ``probe_steps`` steps though the drafter could
  draft for every request speculates at the next plan, paying or not: the best plan predicted to
  lose at most ``probe_loss`` of a plain step against plain decoding (else the one predicted to
  lose least), as a probe re-times and a deep tree for every request of a big batch can cost
  several plain steps. Everything
  that kept it off was learned from steps it no longer takes (verify shapes timed in a slow spell
  of a shared machine, an outcome check that drifts back slowly, a catch-up a drafter must pay
  once): one step re-times them, and the plans after it decide on fresh evidence. While probes
  find nothing that pays after them the wait doubles (up to 1024 steps), so where speculation
  never pays (batch 16 on a CPU) they cost next to nothing; a plan that pays resets it.
* The outcome check: what each speculative step really committed per measured millisecond
  (drafting and verify) over what its plan predicted, as an EMA kept per batch size (a
  power-of-two bucket) and apart for steps with branching trees and steps of chains only, as
  the drafter built them (an engine whose tree attention is a pass of its own can pay more for a
  tree than its models see, and trees then yield to chains where chains deliver; a chains-only
  plan lets the trees' ratio drift back toward 1 as a plain step does both), and by the size of
  the plan's largest tree (:func:`size_class`: 1, 2-3, 4-7, 8-15, ... draft nodes: the acceptance
  model's errors grow with a plan's depth and width, and one ratio for every size would scale
  small plans down for what large ones miss, and large ones too little); below 1 it scales
  speculative plans' predicted rates down
  (:meth:`SpeculationController.outcome_factor`, bounded: a correction, not a second model, and
  never above 1). Whatever the models miss (a verify shape the cost model prices too cheaply, an
  optimistic acceptance) then shows up as speculative steps that deliver less than predicted, and
  marginal speculation at that batch size backs off until it delivers; while no request
  speculates the ratio drifts back toward 1, so it is retried now and then. Plain steps get the
  same check on their own (:meth:`SpeculationController.plain_factor`), which only ever raises
  the bar (never above ``outcome_bound``, nor, with the speculative one, by more than that
  together): the cost model's knots are shared by every forward of
  that many tokens, so a verify of 16 requests x 2 tokens (the standalone engine padded its
  trees then) pulls the 16-token knot that
  prices a plain step of 16 requests, and can price plain steps dearer than they run. A plain
  step slower than predicted never lowers the bar: a comparison with plain steps taken while the
  cost model still learned a new batch shape can make speculation look better than plain
  decoding (``docs/measurements.md``, cost models).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Literal, Sequence

import numpy as np

from dyntree.common.cost_model import CostModel, DraftCosts, batch_bucket
from dyntree.common.options import Budget, ControllerOptions
from dyntree.common.shrinkage import Dispersion
from dyntree.common.tree import DraftTree

__all__ = ["Plan", "SpeculationController"]


@dataclass(frozen=True)
class Plan:
    """What one request should draft this step (``none``: plain decoding, a root-only tree)."""

    mode: Literal["none", "chain", "tree"]
    max_nodes: int
    max_depth: int


@dataclass
class _RequestState:
    got: float  # decayed draft nodes delivered ...
    want: float  # ... of the nodes planned (the drafter's delivery ratio is got / want)
    # per evidence class (Drafter.evidence; 0 for a drafter without): decayed [hits, trials] of the
    # root's first child, and the class of the request's last plan (what alpha reads)
    acc: dict[int, list[float]] = field(default_factory=dict)
    cls: int = 0
    # per evidence class: undecayed [hits, trials] of the root's first child, for the class's
    # dispersion over requests once the request is released (Dispersion)
    seen: dict[int, list[int]] = field(default_factory=dict)


@dataclass
class _Spell:
    """A quiet spell (:meth:`SpeculationController.quiet`): the batch whose plan could not pay,
    the steps it may still skip planning, the backoff that granted them, its requests the drafter
    could draft for, and the best first-draft acceptance that plan judged with each request's
    evidence class then, as ``(request, class)`` pairs (evidence of another class promising more
    ends the spell). Only ``left`` changes while it lasts (:meth:`SpeculationController.quiet`
    counts it down every step)."""

    ids: frozenset = frozenset()
    left: int = 0
    backoff: int = 0
    could: tuple = ()
    judged: float = 0.0
    classes: tuple = ()


class SpeculationController:
    """Decides per step and per request: no speculation, a chain, or a tree with ``(N, D)`` within
    ``budget``."""

    def __init__(self, cost: CostModel, budget: Budget, options: ControllerOptions | None = None,
                 padded: bool = False) -> None:
        self.cost = cost
        self.budget = budget
        # the outcome check's class of a plan by its largest tree's draft nodes: size_class, the
        # budget's largest plans in the class below theirs (a budget of 16 or 32 nodes would
        # otherwise make its full trees a class of their own, beside those one node smaller)
        top = size_class(max(budget.max_nodes - 1, 1))
        self._classes = np.array([min(size_class(n), top) for n in range(budget.max_nodes + 1)])
        self.padded = padded
        self.options = options or ControllerOptions()
        o = self.options
        self.draft_cost = DraftCosts((o.draft_ms_fixed, o.draft_ms_per_depth, o.draft_ms_per_node,
                                      o.draft_ms_per_depth_row))
        self._requests: dict[Hashable, _RequestState] = {}
        # Population acceptance (decayed hits, trials over every request): where a new request
        # starts, so a drafter that is good (or bad) for this workload is priced as such from a
        # request's first step.
        self._pop_hits = o.alpha_prior * o.prior_weight
        self._pop_trials = o.prior_weight
        # The same per evidence class (decayed [hits, trials]): a class's first request starts from
        # the population's acceptance then, and the class learns its own (a drafter without
        # evidence has only class 0, the population itself).
        self._pop_class: dict[int, list[float]] = {}
        # How much the requests of each evidence class differ (Dispersion over released requests):
        # the weight, in observations, of their pooled acceptance in a request's alpha.
        self._dispersion: dict[int, Dispersion] = {}
        # Extra-sibling trials: (decayed) catches, trials, and the sum of the requests' alpha.
        catch = 1 - (1 - o.alpha_prior) ** o.sibling_gain_prior
        self._gain_hits = catch * o.prior_weight
        self._gain_trials = o.prior_weight
        self._gain_alpha = o.alpha_prior * o.prior_weight
        # Population delivery (decayed nodes delivered, planned): a drafter that often finds no
        # draft (n-gram without a match) delivers fewer nodes than planned; new requests start here.
        self._pop_got = self._pop_want = o.prior_weight
        self._planned: dict[Hashable, int] = {}  # the last plan's nodes per request, until observed
        # Per tree level (level j: a node at depth j was reached; a hit: its first child accepted),
        # decayed hits and reaches over every request: how acceptance changes with depth (Hydra's
        # later heads are weaker; an n-gram match that held once tends to hold on). Not measured
        # against each request's own alpha: the chance that a reached level goes on hardly moves
        # with it (the module docstring). The requests that reach deep levels are the ones whose
        # drafts were accepted, and that is the chance a plan needs: the path reached that level.
        # Each level's prior is the level above's rate, worth ``prior_weight`` observations of
        # the level (their EMA weight, decaying as the level is observed), so a level that is
        # rarely reached leans on the one above, and one that is reached learns its own rate
        # within a few dozen observations. Kept per evidence class, as alpha is: a copied
        # passage's deeper drafts go on far more often than a continuation after one shared
        # token's (a class's first level leans on that class's alpha over every request).
        # (per class: [hits, reaches, the reaching requests' alpha summed as reaches are, prior];
        # index k: level k + 1, the first below the root's first child, whose hits are alpha's)
        self._lvl: dict[int, list[list[float]]] = {}
        # _shape per evidence class, until observe learns (it is all that moves a shape)
        self._shapes: dict[int, tuple[float, tuple[tuple[float, float], ...]]] = {}
        # expected_table and its hull steps, by rounded inputs
        self._tables: dict[tuple, tuple[tuple[list[float], list[int]], list[tuple[float, int, int]]]] = {}
        # The outcome check, per batch size (its power-of-two class, batch_bucket): EMAs of the tokens
        # speculative steps committed and of the tokens their plans predicted for the time they
        # took. Their ratio, below 1, scales a speculative plan's predicted rate down for whatever
        # the models miss (a verify shape the cost model prices too cheaply, an optimistic
        # acceptance). A ratio of EMAs, not an EMA of per-step ratios: a step's tokens are random
        # (1 or 7 where 3 were expected), and an EMA of ratios kept at most 1 sat below 1 on
        # noise alone.
        # Kept apart for steps with branching trees and steps of chains only: a tree's verify
        # costs an engine more than the cost models see where its tree attention is a pass of its
        # own (vLLM on a CPU), and one ratio for both would let the dearer shape veto the other.
        # And by plan size (size_class of the largest tree): small plans must not pay for what
        # large ones miss.
        self._outcome: dict[tuple[int, bool, int], tuple[float, float]] = {}  # (bucket, branching, size) -> (got, predicted)
        # The same for plain steps: a plain step faster than its prediction raises the bar that
        # speculation must clear (plain_factor).
        self._plain_outcome: dict[int, tuple[float, float]] = {}
        # the last plan: (predicted rate, rows, speculative, size class of its largest tree)
        self._pending: tuple[float, int, bool, int] | None = None
        # ms an engine spends per branching tree outside the target's forward (EMA; 0 until one
        # is reported): a chain costs none of it, so with it a chains-only plan is priced too; and
        # the plans since one was last reported (after probe_steps of them it drifts toward 0)
        self._branch_ms = 0.0
        self._branch_stale = 0
        # a drafter's catch-ups: EMAs of positions, ms, positions^2 and positions x ms (None until
        # one is reported), and the ms per position a plan is priced at (observe_catch_up)
        self._caught: tuple[float, float, float, float] | None = None
        self._catch_ms = 0.0
        self._quiet = _Spell()  # the quiet spell (:meth:`quiet`), if any
        # per batch size (a power-of-two bucket): EMAs of the ms a plan saves over plain decoding
        # (0 for a plan that drafts nothing), of the share of plans that draft nothing, and of the
        # ms such a plan costs the engine
        self._plan_value: dict[int, float] = {}
        self._plan_idle: dict[int, float] = {}
        self._plan_cost: dict[int, float] = {}
        # ... and the part of that cost spent before the forward (planning and lookups), which a
        # plan that drafts also pays: plain decoding at a step that planned is priced with it
        self._planning: dict[int, float] = {}
        # per batch size (a power-of-two bucket) and apart for steps with drafts (theirs or the
        # previous step's) and without: the EMA of each step's time that neither the forward nor
        # the drafting accounts for (observe_cycle): the engine's own work between forwards, which
        # every step pays, more of it with drafts to prepare, verify and roll back
        self._between: dict[tuple[int, bool], float] = {}
        # per batch size (a power-of-two bucket): steps since a plan last speculated, counting the
        # plans without drafts though the drafter could draft for every request and quiet steps,
        # and the run at which the next probe is due (``probe_steps``, doubling while probes
        # find nothing that pays after them)
        self._plain_run: dict[int, int] = {}
        self._probe_due: dict[int, int] = {}

    # -- estimates ------------------------------------------------------------------------------
    def _state(self, rid: Hashable) -> _RequestState:
        o = self.options
        if rid not in self._requests:
            self._requests[rid] = _RequestState(self._pop_got / self._pop_want * o.prior_weight, o.prior_weight)
        return self._requests[rid]

    def _class_pop(self, cls: int) -> list[float]:
        """Decayed ``[hits, trials]`` of evidence class ``cls`` over every request."""
        w = self.options.prior_weight
        return self._pop_class.setdefault(cls, [self.population_alpha * w, w])

    def _acc(self, rid: Hashable) -> list[float]:
        """A request's decayed ``[hits, trials]`` in the evidence class of its last plan (starting
        where that class stands over every request)."""
        s = self._state(rid)
        if s.cls not in s.acc:
            h, t = self._class_pop(s.cls)
            s.acc[s.cls] = [h / t * self._fresh, self._fresh]
        return s.acc[s.cls]

    @property
    def _fresh(self) -> float:
        """The weight of a request's acceptance prior in its EMA: ``prior_weight`` observations
        (an observation weighs ``ema`` in it, and the EMA's full weight is 1)."""
        o = self.options
        return o.ema * o.prior_weight

    @property
    def population_alpha(self) -> float:
        """Top-1 acceptance over all requests seen (``alpha_prior`` before any): a new request's
        starting estimate."""
        return self._pop_hits / self._pop_trials

    @property
    def _keep(self) -> float:
        """The decay of the population statistics per observation: batch-wide, slowly moving."""
        return 1 - self.options.ema / 4

    def alpha(self, request_id: Hashable) -> float:
        """Current top-1 acceptance estimate of a request, in the evidence class of its last plan:
        its own EMA shrunk toward the class's finished requests' acceptance (:meth:`_shrunk`)."""
        return self._shrunk(self._acc(request_id), self._state(request_id).cls)

    def _class_alpha(self, request_id: Hashable, cls: int) -> float:
        """What :meth:`alpha` would read for a request planned in evidence class ``cls`` (its own
        statistics there, else the class's over every request, else the population's), changing
        nothing."""
        s = self._requests.get(request_id)
        if s is not None and cls in s.acc:
            return self._shrunk(s.acc[cls], cls)
        hits, trials = self._pop_class.get(cls, [self.population_alpha, 1.0])
        return hits / trials

    def _shrunk(self, acc: Sequence[float], cls: int) -> float:
        """A request's decayed ``[hits, trials]`` in class ``cls``, with the acceptance of the
        class's released requests added at the weight their dispersion gives it (none until two
        are measured; :class:`Dispersion`): where requests hardly differ, a few misses in a row
        do not stop one request's drafting. The released requests' rate moves only as requests
        finish, so a spell of misses that stops every request's drafting in the class does not
        also pull the shared estimate down with it."""
        d = self._dispersion.get(cls)
        w = self.options.ema * d.strength() if d is not None else 0.0
        if w == 0.0:
            return acc[0] / acc[1]
        return (acc[0] + w * d.rate) / (acc[1] + w)

    def delivery(self, request_id: Hashable) -> float:
        """Expected fraction of planned draft nodes the drafter delivers for a request."""
        s = self._state(request_id)
        return s.got / s.want

    def _level_stats(self, cls: int) -> list[list[float]]:
        """Evidence class ``cls``'s decayed level statistics: ``[hits, reaches, alpha, prior]``,
        one entry per level below the root's first child."""
        if cls not in self._lvl:
            deeper = max(self.budget.max_depth - 1, 0)
            self._lvl[cls] = [[0.0] * deeper, [0.0] * deeper, [0.0] * deeper,
                              [self.options.prior_weight * (1 - self._keep)] * deeper]
        return self._lvl[cls]

    def level_acceptance(self, cls: int = 0) -> list[tuple[float, float]]:
        """Per tree level below the root's first child (index ``k``: level ``k + 2``), over every
        request that reached it in evidence class ``cls``: the chance that a node reached there
        has its first child accepted, and those requests' mean alpha; a level with little evidence
        leans on the level above it (the first, on the class's alpha over every request)."""
        hits, trials = self._class_pop(cls)
        levels, above, seen = [], hits / trials, hits / trials
        for h, n, a, p in zip(*self._level_stats(cls)):
            above, seen = (h + p * above) / (n + p), (a + p * seen) / (n + p)
            levels.append((above, seen))
        return levels

    @staticmethod
    def _level_rates(alpha: float, levels: Sequence[tuple[float, float]]) -> list[float]:
        """A request's acceptance per level, root's first child first: its ``alpha``, then each
        deeper level's rate, half of it as measured over every request and half scaled by the
        request's alpha over theirs (partial pooling: measured in vLLM a reached level's rate
        hardly moves with the request's alpha, but a batch where one request copies a passage
        must not lend its deep levels whole to the others)."""
        return [alpha] + [rate * (0.5 + 0.5 * alpha / max(seen, 1e-3)) for rate, seen in levels]

    def outcome_factor(self, rows: int = 1, branching: bool = False, nodes: int | None = None) -> float:
        """At batches of ``rows`` requests, the measured over predicted throughput of speculative
        steps (1.0 until that class is observed), of steps with ``branching`` trees or of chains
        only, whose largest tree has ``nodes`` draft nodes (its :func:`size_class`; ``None``:
        every size of that shape pooled): what such a plan's predicted rate is multiplied by, within
        ``[1 / outcome_bound, 1]``, except that a plan class that delivers less of its prediction
        than the best class is scaled by that class's factor times the ratio of the two (below the
        bound if it must), so classes stay ranked as measured. It only ever vetoes: a measured rate
        above the prediction does not talk the planner into speculation its models say does not pay."""
        if nodes is None:
            pooled = self._outcome_ratios(rows, pooled=True)
            return _factor(pooled.get(branching), pooled.values(), self.options.outcome_bound)
        return float(self._outcome_factors(rows, 0.0)[int(branching), self._classes[nodes]])

    def _outcome_ratios(self, rows: int, pooled: bool = False) -> dict:
        """The bucket's measured over predicted ratios by ``(branching, size class)``, or with
        ``pooled`` by ``branching`` (ratios of the summed EMAs)."""
        bucket = batch_bucket(rows)
        if not pooled:
            return {(k, c): got / want for (b, k, c), (got, want) in self._outcome.items() if b == bucket}
        sums: dict[bool, list[float]] = {}
        for (b, k, _), (got, want) in self._outcome.items():
            if b == bucket:
                acc = sums.setdefault(k, [0.0, 0.0])
                acc[0] += got
                acc[1] += want
        return {k: got / want for k, (got, want) in sums.items()}

    def _outcome_factors(self, rows: int, floor: float) -> np.ndarray:
        """``[2, classes]``: :meth:`outcome_factor` of chains-only plans (row 0) and of plans
        with branching trees (row 1) for each size class up to the budget's (index: the class,
        ``_classes``); one pass over the bucket's ratios. The best measured class is raised to
        ``floor`` if it is below, and every measured class with it: the floor bounds how far the
        checks may hold speculation back, not how the classes rank (floored one by one, trees
        measured at 0.77 of their prediction and chains of 4-7 nodes at 0.90 both read 0.88 under a
        plain factor of 1.1, and trees that did not pay kept being planned)."""
        ratios = self._outcome_ratios(rows)
        out = [[1.0] * (int(self._classes[-1]) + 1) for _ in range(2)]
        bound = self.options.outcome_bound
        measured = {(int(k), c): _factor(own, ratios.values(), bound) for (k, c), own in ratios.items()}
        if measured:
            lift = max(1.0, floor / max(measured.values()))
            for (k, c), f in measured.items():
                out[k][c] = f * lift
        return np.array(out)

    def plain_factor(self, rows: int = 1) -> float:
        """At batches of ``rows`` requests, the measured over predicted throughput of plain steps
        (1.0 until observed), within ``[1, outcome_bound]``: what plain decoding's predicted rate
        is multiplied by where speculation is compared with it. It only ever raises the bar: a
        plain step slower than predicted does not talk the planner into speculation."""
        got, want = self._plain_outcome.get(batch_bucket(rows), (1.0, 1.0))
        return min(max(got / want, 1.0), self.options.outcome_bound)

    def objective(self, waiting: int | None) -> Literal["throughput", "batch"]:
        """What plans maximise (``ControllerOptions.objective``): ``auto`` is ``batch`` when the
        engine reports that no request waits (``waiting == 0``), else ``throughput``."""
        o = self.options.objective
        if o == "auto":
            return "batch" if waiting == 0 else "throughput"
        return o

    @property
    def sibling_gain(self) -> float:
        """Fitted ``g``: extra-sibling catch rate ``c = 1 - (1 - alpha)^g`` solved for ``g``."""
        catch = min(self._gain_hits / self._gain_trials, 1 - 1e-9)
        log_miss = math.log1p(-min(self._gain_alpha / self._gain_trials, 1 - 1e-9))
        if log_miss > -1e-9:
            return self.options.sibling_gain_prior
        return min(max(math.log1p(-catch) / log_miss, 0.0), 1.0)

    def expected_table(self, alpha: float, delivery: float = 1.0, cls: int = 0) -> tuple[list[float], list[int]]:
        """``(E[n], best_depth[n])`` for ``n = 0..max_nodes`` draft nodes at acceptance ``alpha``
        (deeper levels at :meth:`level_acceptance` of evidence class ``cls``), times ``delivery``, the fraction of planned
        nodes the drafter actually drafts (an n-gram drafter finds no match about half the time:
        its plans are worth half as much).

        Plain Python floats: the table is small (``max_nodes x max_depth``), where tensor ops
        would cost more in dispatch than in math. Tables are kept by their inputs rounded to 0.01
        (alpha, delivery, the level acceptance and the sibling gain): every request's alpha moves every
        step it drafts, and at a finer grain a batch recomputes a table per request every step; a
        delivery only scales a table (the best depth does not change)."""
        return self._table(alpha, delivery, False, self._shape(cls))[0]

    def _shape(self, cls: int = 0) -> tuple[float, tuple[tuple[float, float], ...]]:
        """The sibling gain and evidence class ``cls``'s level acceptance as the tables are kept
        by (rounded to 0.01)."""
        shape = self._shapes.get(cls)
        if shape is None:
            shape = self._shapes[cls] = (round(self.sibling_gain, 2), tuple(
                (round(r, 2), round(a, 2)) for r, a in self.level_acceptance(cls)))
        return shape

    def _table(self, alpha: float, delivery: float, chains: bool,
               shape: tuple[float, tuple[tuple[float, float], ...]],
               ) -> tuple[tuple[list[float], list[int]], list[tuple[float, int, int]]]:
        """:meth:`expected_table` (``chains``: of chains only) and the steps of its upper concave
        hull (:meth:`_hull`), cached; ``shape``: :meth:`_shape` of the request's evidence class."""
        n_max = self.budget.max_nodes
        if self.budget.max_depth == 0:
            return ([0.0] * (n_max + 1), [0] * (n_max + 1)), []
        gain, levels = shape
        base_key = (round(alpha, 2), 1.0, gain, levels, chains)
        key = (base_key[0], round(delivery, 2), gain, levels, chains)
        entry = self._tables.get(key)
        if entry is None:
            if len(self._tables) >= 4096:
                self._tables.clear()
            base = self._tables.get(base_key)
            if base is None:
                e, depth = self._expected(base_key[0], gain, levels, chains)
                base = self._tables[base_key] = ((e, depth), self._hull(e))
            if key == base_key:
                return base
            e, depth = base[0]
            scaled = [key[1] * x if x >= 0 else -1.0 for x in e]
            # scaled down, a table keeps its hull's corners: the full table's steps, rescaled
            steps = (self._worth([((scaled[m] - scaled[n]) / (m - n), n, m) for _, n, m in base[1]])
                     if 0 < key[1] <= 1 else self._hull(scaled))
            entry = self._tables[key] = ((scaled, depth), steps)
        return entry

    def _expected(self, alpha: float, gain: float, levels: Sequence[tuple[float, float]],
                  chains: bool = False) -> tuple[list[float], list[int]]:
        """:meth:`expected_table` computed at full delivery: a tree of ``n`` nodes and depth ``d``
        has ``n / d`` nodes per level; level ``j`` catches the target's token with ``beta_j = 1 -
        (1 - alpha_j)^(1 + g (n / d - 1))``, and ``E = beta_1 + beta_1 beta_2 + ...`` (-1: no such
        tree; ``chains``: only ``d = n``)."""
        o = self.options
        rates = self._level_rates(alpha, levels)
        miss = [1 - min(max(a, 0.0), 1 - 1e-9) for a in rates]
        n_max, d_max = self.budget.max_nodes, len(rates)
        if chains or not o.allow_trees:  # one node per level: E(n) sums the first n levels' reach
            best, e, reach = [0.0], 0.0, 1.0
            for m in miss[:n_max]:
                reach *= 1 - m
                e += reach
                best.append(e)
            return best + [-1.0] * (n_max + 1 - len(best)), [n if n <= d_max else 0 for n in range(n_max + 1)]
        n = np.arange(1, n_max + 1, dtype=np.float64)[:, None]
        d = np.arange(1, d_max + 1, dtype=np.float64)[None, :]
        expo = 1 + gain * (np.maximum(n / d, 1.0) - 1)  # [n, d]
        # [n, d, j]: level j's catch in a tree of n nodes and depth d; E(n, d) sums levels j < d
        reach = np.cumprod(1 - np.array(miss)[None, None, :] ** expo[:, :, None], axis=2)
        e = np.cumsum(reach, axis=2)[:, np.arange(d_max), np.arange(d_max)]
        e = np.where(d <= n, e, -np.inf)
        d_best = np.argmax(e, axis=1)  # the first of the best depths
        return [0.0] + e[np.arange(n_max), d_best].tolist(), [0] + (d_best + 1).tolist()

    # -- planning -------------------------------------------------------------------------------
    def plan(self, request_ids: Sequence[Hashable], kv: int | None = None,
             available: Sequence[bool] | None = None, catch_up: Sequence[int] | None = None,
             remaining: Sequence[int | None] | None = None, waiting: int | None = None,
             evidence: Sequence[int] | None = None) -> list[Plan]:
        """One plan per live request for the next verify step; ``kv``: the cached tokens each
        query row of the verify attends to (one rectangular cache: the longest request's), priced by
        the cost model's attention term; ``available``: which requests the drafter can draft for
        this step, when it knows beforehand (``Drafter.can_draft``): the others are planned no
        draft, the rest at their delivery ratio among the steps it could draft; ``catch_up``: the
        positions each request's draft must first catch up with (``Drafter.catch_up``), priced
        per position (:meth:`observe_catch_up`) in a plan that drafts for it, spread over the steps
        it serves (``catch_up_steps`` over the batch size, times the share of this batch size's
        plans that drafted); ``remaining``: the
        tokens each request may still commit (``None``: unknown) and ``waiting``: the requests the
        engine holds back for want of room (``None``: unknown), which choose the objective
        (:meth:`objective`); ``evidence``: each request's class of what the drafter knows before
        drafting (``Drafter.evidence``), whose acceptance the request is planned by and learns."""
        o = self.options
        b = len(request_ids)
        if b == 0:
            return []
        if evidence is not None:
            for rid, cls in zip(request_ids, evidence):
                self._state(rid).cls = int(cls)
        can = list(available) if available is not None else [True] * b
        bucket = batch_bucket(b)
        catch_ms = [0.0] * b
        if catch_up is not None and self._catch_ms > 0:
            # a catch-up is paid once and serves the request's later steps that draft: priced spread
            # over them, at the share of this batch size's plans that drafted (where plans seldom
            # draft, it serves about one)
            cap = max(o.catch_up_steps // b, 1)
            drafting = 1.0 - self._plan_idle.get(bucket, 0.0)
            catch_ms = [self._catch_ms * n / max(_served_steps(rest, cap) * drafting, 1.0)
                        for n, rest in zip(catch_up, remaining if remaining is not None else [None] * b)]
        # each request's table by its alpha, delivery and evidence class (whose level acceptance it reads)
        keys = [(self.alpha(r), self.delivery(r) if ok else 0.0, self._state(r).cls) for r, ok in zip(request_ids, can)]
        slack = _slack(remaining, b) if self.objective(waiting) == "batch" and b > 1 else None
        plain_ms = self.cost(b, kv, b)
        plain = b / plain_ms
        # every step pays it: plans are ranked with it (a plain step's, a step with drafts')
        between = (self.between_ms(b, False), self.between_ms(b, True))
        raise_bar = self.plain_factor(b)
        # what plain decoding delivers, as measured, after this plan: its drafting is priced in
        # full (planning included, as measured), so the planning it pays anyway is priced here too
        planning = self._planning.get(bucket, 0.0)
        plain_step = plain_ms + between[0] + planning
        bar = b / plain_step * raise_bar
        # the two checks together move the best measured plan class by at most outcome_bound, as each
        # does alone (the other classes keep their measured shortfall against it)
        factors = self._outcome_factors(b, raise_bar / o.outcome_bound)
        factor = float(factors.max())  # for the bounds: no plan is scaled by more
        # a probe: after probe_steps without speculation, the best plan is taken even below the bar
        # (the models it was judged by were learned while it paid less, or with catch-up to pay)
        due = self._probe_due.get(bucket, o.probe_steps)
        probe = bool(o.probe_steps) and all(can) and self._plain_run.get(bucket, 0) >= due
        best_rate, best_k, tables, segments, best_tokens, best_branching = 0.0 if probe else bar, 0, [], [], bar, 0
        used, widest = 1.0, 0  # the best plan's outcome factor and largest tree
        shapes = {cls: self._shape(cls) for cls in {key[2] for key in keys}}  # once per class
        # no plan pays though the drafter could draft for every request, or could not pay if it could
        hopeless = False
        # the bound's least forward (a probe does not consult the bound)
        floor_ms = plain_ms if probe else self._least_forward(b, kv, plain_ms) + min(between)
        # trees; then, where the best plan holds branching trees that cost the engine extra, chains only
        for chains in (False, True):
            cache = {key: self._table(key[0], key[1], chains, shapes[key[2]]) for key in set(keys)}
            tabs = [cache[k][0] for k in keys]
            if not probe and self._beyond_reach(tabs, [cache[k][1] for k in keys], slack, floor_ms, factor, bar, catch_ms):
                if not chains and not all(can):
                    every = [self._table(a, self.delivery(r), False, shapes[cls]) for r, (a, _, cls) in zip(request_ids, keys)]
                    hopeless = self._beyond_reach([t[0] for t in every], [t[1] for t in every], slack,
                                                  floor_ms, factor, bar, catch_ms)
                break  # nor with chains
            # Segments of each request's upper concave hull: (gain per token, request, n_from, n_to).
            segs = [(gain, r, lo, hi) for r, k in enumerate(keys) for gain, lo, hi in cache[k][1]]
            if slack is None:  # throughput: the best gain per token first
                segs.sort(key=lambda s: (-s[0], s[1], s[2]))
            else:  # the batch's pace: water-filling, the slowest request's next step first
                segs.sort(key=lambda s: (slack[s[1]] * (1 + tabs[s[1]][0][s[2]]), s[1], s[2]))
            rate, k, branching, tokens_rate, f, w = self._scan(segs, tabs, keys, kv, plain_ms, factors, catch_ms, slack,
                                                               o.probe_loss * plain_ms if probe else None, between,
                                                               planning)
            if rate > best_rate:
                best_rate, best_k, tables, segments, best_tokens, best_branching = rate, k, tabs, segs, tokens_rate, branching
                used, widest = f, w
            if not (branching and self._branch_ms > 0 and o.allow_trees):
                break
        alloc = [0] * b
        for _, r, lo, hi in segments[:best_k]:
            alloc[r] = hi
        speculate = best_k > 0 and (probe or best_rate >= bar * o.min_gain)
        self._plain_run[bucket] = 0 if speculate else self._plain_run.get(bucket, 0) + int(all(can))
        if speculate:  # a probe doubles the wait for the next; a plan that pays on its own resets it
            self._probe_due[bucket] = min(2 * due, _PROBE_MAX) if probe else o.probe_steps
        # what planning earns at this batch size: the ms a plan saves over plain decoding (0 when
        # it drafts nothing, or a probe's predicted loss), against what a plan that drafts nothing
        # costs (observe_plan_cost)
        saved = plain_step * max(best_rate / bar - 1, 0.0) if speculate else 0.0
        _ema_into(self._plan_value, bucket, saved, o.ema)
        _ema_into(self._plan_idle, bucket, 0.0 if speculate else 1.0, o.ema)
        hopeless = not speculate and (hopeless or all(can))
        if not speculate and not hopeless:
            # held back by requests the drafter has nothing for (an n-gram lookup without a
            # match): the next step may have matches, so the batch plans on while planning pays:
            # while a plan saves more on average than the plans that draft nothing cost, each
            # as often as they come (a plan that drafts pays its own planning in its drafting time)
            hopeless = not self._planning_pays(bucket)
        if hopeless:
            self._go_quiet(request_ids, plain_ms, tuple(r for r, c in zip(request_ids, can) if c),
                           max((key[0] for key, c in zip(keys, can) if c), default=self.population_alpha),
                           tuple((r, key[2]) for r, key in zip(request_ids, keys)))
        else:  # a probe below the bar ends the spell but keeps its backoff: a probe that finds
            # nothing paying does not restart the spells at one step (each plan that ends one
            # costs what a plan does: at batch 8 on a CPU, milliseconds)
            keep = speculate and best_rate < bar * o.min_gain
            self._quiet = _Spell(backoff=self._quiet.backoff) if keep else _Spell()
        if not speculate:
            alloc = [0] * b
            self._relax_outcome(b)
        elif not best_branching:
            self._relax_outcome(b, branching_only=True)
        if not (speculate and best_branching):
            self._relax_branching()
        # the outcome check compares committed tokens with the tokens the plan predicted
        self._pending = (best_tokens / used, b, True, int(self._classes[widest])) if speculate else (plain, b, False, 0)
        plans = []
        for r, (rid, n) in enumerate(zip(request_ids, alloc)):
            self._planned[rid] = n
            if n == 0 and not can[r]:
                plans.append(Plan("none", 0, 0))  # nothing to draft: no choice, no evidence
            elif n == 0:
                self._relax(rid)
                plans.append(Plan("none", 0, 0))
            else:
                d = int(tables[r][1][n])
                plans.append(Plan("chain" if d == n else "tree", n, d))
        return plans

    def _planning_pays(self, bucket: int) -> bool:
        """Whether plans at this batch size save more milliseconds on average (0 for a plan without
        drafts) than the plans without drafts cost the engine, each as often as they come."""
        return self._plan_value.get(bucket, 0.0) >= self._plan_idle.get(bucket, 0.0) * self._plan_cost.get(bucket, 0.0)

    def _spell_cap(self, bucket: int, plain_ms: float) -> int:
        """The longest quiet spell at this batch size: ``quiet_steps``, or as many steps (up to
        ``_QUIET_MAX``) as it takes for the plan that ends the spell, which drafts nothing and
        costs what such plans cost here (:meth:`observe_plan_cost`), to cost at most
        ``quiet_share`` of the spell's plain steps (``plain_ms`` each)."""
        o = self.options
        if o.quiet_steps == 0 or o.quiet_share == 0 or not plain_ms > 0:
            return o.quiet_steps
        need = math.ceil(self._plan_cost.get(bucket, 0.0) / (o.quiet_share * plain_ms)) - 1
        return max(o.quiet_steps, min(need, _QUIET_MAX))

    def quiet(self, request_ids: Sequence[Hashable],
              foresight: Callable[[], tuple[Sequence[bool] | None, Sequence[int] | None]] | None = None) -> bool:
        """Whether this step of ``request_ids`` may decode plainly without a plan: the same batch's
        recent plans found nothing that pays though the drafter could draft for every request (or
        a bound says nothing could if it could), so for a few steps (the backoff doubling while
        such plans keep coming, up to :meth:`_spell_cap`) the engine skips planning, drafting and
        verification. A drafter that had nothing for some requests (an n-gram lookup without a
        match) but might pay when it has keeps planning every step while planning pays its way at
        this batch size: while its plans' saved milliseconds (an EMA, 0 for a plan without
        drafts) stay below what the plans without drafts cost (:meth:`observe_plan_cost`, times
        their share of the plans), such a batch goes quiet too. What is left of that batch when
        some of its requests finish stays quiet while it keeps its batch size (its power-of-two
        class, as plans are priced): the rest were planned in it and found wanting, and a
        batch of 16 whose requests end one by one would otherwise plan at every ending. A request
        that joins ends the spell, and so does evidence that promises a better first draft than the
        best the spell's plan judged, in a class other than the one the request was judged in (an
        n-gram match longer than the one that was not worth drafting may): ``foresight()`` gives
        which requests the drafter could draft for and each one's class now, as :meth:`plan` takes
        them. It is asked only on a step the spell covers, at a batch size where planning pays its
        way (:meth:`_planning_pays`; where no plan has saved time lately, a better match would not
        either). Counts the step when it says so."""
        spell = self._quiet
        now = frozenset(request_ids)
        bucket = batch_bucket(len(now))
        if spell.left <= 0 or not now or not (now == spell.ids or (now < spell.ids and bucket == batch_bucket(len(spell.ids)))):
            return False
        available, evidence = foresight() if foresight is not None and self._planning_pays(bucket) else (None, None)
        if evidence is not None:
            was = dict(spell.classes)
            can = available if available is not None else [True] * len(request_ids)
            if any(ok and int(cls) != was.get(rid) and self._class_alpha(rid, int(cls)) > spell.judged
                   for rid, cls, ok in zip(request_ids, evidence, can)):
                return False
        spell.left -= 1
        self._plain_run[bucket] = self._plain_run.get(bucket, 0) + 1
        for rid in spell.could:  # an idle step, as a plan without drafts would count it
            if rid in now:
                self._relax(rid)
        self._relax_outcome(len(request_ids))
        return True

    def idle(self, request_ids: Sequence[Hashable], kv: int | None = None,
             evidence: Sequence[int] | None = None) -> None:
        """A step of ``request_ids`` decoded plainly without a plan, as the drafter had nothing for
        any of them (``Drafter.can_draft``: an n-gram lookup without a match anywhere; ``kv`` and
        ``evidence`` as :meth:`plan` takes them). There was no choice to make, so planning's worth
        at this batch size and the steps counted toward a probe stay as they were. The quiet
        spells go on as after a plan held back by requests without drafts: where planning pays
        its way (:meth:`_planning_pays`) the backoff restarts (matches come and go: the next one
        is planned afresh), elsewhere the next spell begins, its backoff doubled. The outcome
        check relaxes as on any step without drafts."""
        b = len(request_ids)
        if self._planning_pays(batch_bucket(b)):
            self._quiet = _Spell()
        else:
            classes = evidence if evidence is not None else [0] * b
            self._go_quiet(request_ids, self.cost(b, kv, b), (), self.population_alpha,
                           tuple((r, int(c)) for r, c in zip(request_ids, classes)))
        self._relax_outcome(b)

    def _go_quiet(self, request_ids: Sequence[Hashable], plain_ms: float, could: tuple[Hashable, ...],
                  judged: float, classes: tuple[tuple[Hashable, int], ...]) -> None:
        """Begin the batch's next quiet spell (:meth:`quiet`): one step, or twice the last spell's
        length up to :meth:`_spell_cap`; ``could``: the requests the drafter could have drafted
        for, ``judged``: the best of their acceptance, ``classes``: each request's evidence class."""
        last = self._quiet.backoff
        backoff = (min(2 * last, self._spell_cap(batch_bucket(len(request_ids)), plain_ms)) if last
                   else min(1, self.options.quiet_steps))
        self._quiet = _Spell(frozenset(request_ids), backoff, backoff, could, judged, classes)

    def _relax(self, rid: Hashable) -> None:
        """A step without a draft for a request that could have had one: no evidence, so its
        acceptance drifts back toward the better of the population's and the prior (and its
        delivery toward full) until a short probe pays again (one unlucky step must not end a
        good drafter's speculation for the rest of a request)."""
        o, s, acc = self.options, self._state(rid), self._acc(rid)
        h, t = self._class_pop(s.cls)
        alpha = acc[0] / acc[1]
        acc[1] += o.relax * (self._fresh - acc[1])
        acc[0] = acc[1] * (alpha + o.relax * (max(h / t, o.alpha_prior) - alpha))
        s.got += o.relax * (s.want - s.got)

    def _relax_outcome(self, rows: int, branching_only: bool = False) -> None:
        """A step without speculation at ``rows`` requests (or ``branching_only``: one whose plan
        had no branching tree): the speculative outcome checks (or that of plans with branching
        trees) drift back toward 1, so a bad spell (or a cost model that was wrong and has
        learned since) does not end speculation, or trees, at this batch size."""
        bucket = batch_bucket(rows)
        for key, (got, want) in self._outcome.items():
            if key[0] == bucket and (key[1] or not branching_only):
                self._outcome[key] = (got + self.options.outcome_relax * (want - got), want)

    def _relax_branching(self) -> None:
        """A plan without branching trees: once ``probe_steps`` such plans have come since an
        engine last timed one, the learned ms per branching tree drifts toward 0 (``relax`` a
        plan), so trees are timed anew now and then, and the next timing is taken whole
        (:meth:`observe_branching`). It is learned only from the trees that are
        planned: one slow tree (the first of an engine, which pays the tree path's one-time
        costs, or one in a slow spell) would otherwise price trees out for good."""
        self._branch_stale += 1
        if self._branch_stale > self.options.probe_steps:
            self._branch_ms *= 1 - self.options.relax

    def _least_forward(self, b: int, kv: int | None, plain_ms: float) -> float:
        """The cheapest forward a plan for ``b`` requests can take, a plain step's included: a
        verify may cost less than a plain step (vLLM's CPU forward at batch 1 costs more at 1-2
        query tokens than at 3-5)."""
        n_max = self.budget.max_nodes
        if self.padded:
            tokens = b * (1 + np.arange(1, n_max + 1, dtype=np.float64))
            return min(plain_ms, float(np.min(self.cost(tokens, kv, b))))
        hi = min(b * (1 + n_max), self.options.max_batch_tokens)
        return plain_ms if hi <= b else min(plain_ms, self.cost.least(b + 1, hi, kv, b))

    def _beyond_reach(self, tables: Sequence[tuple[list[float], list[int]]], hulls: Sequence[list[tuple[float, int, int]]],
                      slack: np.ndarray | None, floor_ms: float, factor: float, bar: float,
                      catch_ms: list[float]) -> bool:
        """Whether no plan can clear the bar, by a bound that is cheaper than the scan: every
        request's best tree, for a verify at the cheapest forward's cost (``floor_ms``,
        :meth:`_least_forward`), plus the least drafting a plan that pays must do. For throughput
        that is one request's one node; for the batch's pace every request whose slack is below
        ``min_gain`` must draft (the pace of one that does not stays at its slack), and catch up
        first."""
        o = self.options
        top = np.array([t[0][h[-1][2]] if h else 0.0 for t, h in zip(tables, hulls)])
        b = len(tables)
        if slack is None:
            best, least = b + float(top.sum()), floor_ms + self.draft_cost(1, 1, 1)
        else:
            must = slack < o.min_gain
            k = max(int(must.sum()), 1)
            best = b * float((slack * (1 + top)).min())
            least = floor_ms + self.draft_cost(1, k, k) + float(np.asarray(catch_ms)[must].sum())
        return factor * best / least < bar * o.min_gain

    def _scan(self, segments: list[tuple[float, int, int, int]], tables: list[tuple[list[float], list[int]]],
              keys: list[tuple[float, float, int]], kv: int | None, plain_ms: float,
              factors: np.ndarray, catch_ms: list[float], slack: np.ndarray | None = None,
              max_loss_ms: float | None = None,
              between_ms: tuple[float, float] = (0.0, 0.0),
              planning_ms: float = 0.0) -> tuple[float, int, int, float, float, int]:
        """The best prefix of ``segments`` (merged hull steps in the order they are taken): its
        predicted rate, length, branching trees, predicted committed tokens per ms, outcome
        factor and largest tree's nodes, the rates times the outcome factor of chains-only plans
        or of plans with branching trees at the size class of the prefix's largest tree
        (``factors``, from :meth:`_outcome_factors`). The rate is committed tokens per ms, or with ``slack`` (each
        request's tokens left, the most over its own: the ``batch`` objective) the batch's pace:
        ``batch`` times the lowest ``slack x (1 + E)`` over its requests, per ms. A prefix pays its
        verify forward (plain with the chance that no planned tree arrives), its drafting, the
        catch-up of each request it drafts for (``catch_ms``) and, per branching tree in it, the
        engine's extra time for one (:meth:`observe_branching`). ``max_loss_ms`` (a probe's): only
        prefixes predicted to take at most that much longer than plain decoding takes for their
        committed tokens are chosen from (or, if none, the one predicted to lose least).
        ``between_ms``: the engine's time between forwards (:meth:`observe_cycle`) of a plain step
        and of a step with drafts, which every step pays (a plan's at the chance that some planned
        tree arrives, else a plain step's): in the rate a plan is ranked by, not in the committed
        tokens per ms returned for the outcome check (which measures the forward and the drafting
        only). ``planning_ms``: what planning costs a plain step after it (:meth:`observe_plan_cost`),
        in the plain decoding a probe's loss is measured against."""
        if not segments:
            return 0.0, 0, 0, 0.0, 1.0, 0
        b, n = len(keys), len(segments)
        r = np.fromiter((s[1] for s in segments), np.int64, n)
        lo = np.fromiter((s[2] for s in segments), np.int64, n)
        hi = np.fromiter((s[3] for s in segments), np.int64, n)
        # every prefix at once: its nodes, widest tree and verify tokens (non-decreasing), cut
        # where the verify would exceed max_batch_tokens
        nodes = np.cumsum(hi - lo)
        tokens = self._verify_tokens(b, nodes, np.maximum.accumulate(hi))
        n = int(np.searchsorted(tokens, self.options.max_batch_tokens, side="right"))
        if n == 0:
            return 0.0, 0, 0, 0.0, 1.0, 0
        r, lo, hi, nodes, tokens = r[:n], lo[:n], hi[:n], nodes[:n], tokens[:n]
        gained = np.fromiter((tables[q][0][h] - tables[q][0][l] for q, l, h in zip(r.tolist(), lo.tolist(), hi.tolist())),
                             np.float64, n)
        depth_hi = np.fromiter((tables[q][1][h] for q, h in zip(r.tolist(), hi.tolist())), np.int64, n)
        depth_lo = np.fromiter((tables[q][1][l] for q, l in zip(r.tolist(), lo.tolist())), np.int64, n)
        first = lo == 0  # a request's first segment: its tree arrives with its delivery ratio
        delivery = np.array([k[1] for k in keys])[r]
        no_tree = np.cumprod(np.where(first, 1.0 - delivery, 1.0))  # chance that no planned tree arrives
        drafting = np.cumsum(first)
        catching = np.cumsum(np.where(first, np.asarray(catch_ms)[r], 0.0))
        branching = np.cumsum((depth_hi < hi).astype(np.int64) - (~first & (depth_lo < lo)))
        max_depth = np.maximum.accumulate(depth_hi)
        forward = (1.0 - no_tree) * self.cost(tokens, kv, b) + no_tree * plain_ms
        spent = forward + self.draft_cost(max_depth, nodes, drafting) + self._branch_ms * branching + catching
        widest = np.maximum.accumulate(hi)
        factor = factors[(branching > 0).astype(np.int64), self._classes[widest]]
        tokens = factor * np.cumsum(np.concatenate(([float(b)], gained)))[1:]
        committed = tokens / spent
        paid = spent + (1.0 - no_tree) * between_ms[1] + no_tree * between_ms[0]
        rate = tokens / paid if slack is None else factor * b * self._pace(r, lo, hi, tables, slack) / paid
        if max_loss_ms is not None:  # a probe: the best of the plans that lose little, else the least loss
            loss = paid - tokens * (plain_ms + between_ms[0] + planning_ms) / b  # ms over plain decoding's for the same tokens
            rate = np.where(loss <= max(max_loss_ms, float(loss.min())), rate, -np.inf)
        k = int(np.argmax(rate))  # the first of the best
        return float(rate[k]), k + 1, int(branching[k]), float(committed[k]), float(factor[k]), int(widest[k])

    @staticmethod
    def _pace(r: np.ndarray, lo: np.ndarray, hi: np.ndarray, tables: list[tuple[list[float], list[int]]],
              slack: np.ndarray) -> np.ndarray:
        """After each prefix of water-filling segments (ordered by the value ``slack x (1 + E)``
        their request starts them at), the lowest value over the batch: the next segment's start
        (every request with a segment left is at its next one's start, the lowest first), a
        request whose segments are all taken (its last value), or one that has none (its slack)."""
        n = len(r)
        e = [tables[q][0] for q in r.tolist()]
        start = slack[r] * (1 + np.fromiter((t[l] for t, l in zip(e, lo.tolist())), np.float64, n))
        end = slack[r] * (1 + np.fromiter((t[h] for t, h in zip(e, hi.tolist())), np.float64, n))
        last = np.zeros(n, dtype=bool)
        last[n - 1 - np.unique(r[::-1], return_index=True)[1]] = True  # each request's last segment
        done = np.minimum.accumulate(np.where(last, end, np.inf))
        untouched = np.ones(len(slack), dtype=bool)
        untouched[r] = False
        idle = float(slack[untouched].min()) if untouched.any() else np.inf
        return np.minimum(np.minimum(np.append(start[1:], np.inf), done), idle)

    def _verify_tokens(self, batch: int, nodes: "int | np.ndarray", widest: "int | np.ndarray") -> "int | np.ndarray":
        """Query tokens of the verify forward (numbers, or arrays of plans): roots plus draft
        nodes, or, for an engine that pads every tree of the batch to the widest (``padded``),
        ``batch x (1 + widest)``."""
        return batch * (1 + widest) if self.padded else batch + nodes

    def _hull(self, e: list[float]) -> list[tuple[float, int, int]]:
        """Upper-concave-hull steps ``(gain per node, n_from, n_to)`` of ``E[n]`` worth taking."""
        n_max = self.budget.max_nodes
        x = np.asarray(e, dtype=np.float64)
        m = np.arange(n_max + 1)
        # gains[n, m]: E's gain per node from n to m nodes (m > n; -1: no tree of m nodes)
        with np.errstate(divide="ignore", invalid="ignore"):
            gains = np.where(x[None, :] >= 0, (x[None, :] - x[:, None]) / (m[None, :] - m[:, None]), -1.0)
        gains = np.where(m[None, :] > m[:, None], gains, -np.inf)
        first = gains.argmax(axis=1)  # the first of the largest
        to, best = first.tolist(), gains[m, first].tolist()
        steps, n = [], 0
        while n < n_max:
            steps.append((best[n], n, to[n]))
            n = to[n]
        return self._worth(steps)

    def _worth(self, steps: list[tuple[float, int, int]]) -> list[tuple[float, int, int]]:
        """The hull ``steps`` (gains non-increasing) before the first worth less than
        ``min_node_value`` a node."""
        return list(itertools.takewhile(lambda s: s[0] >= self.options.min_node_value, steps))

    # -- feedback -------------------------------------------------------------------------------
    def observe(self, request_id: Hashable, tree: DraftTree, accepted_nodes: Sequence[int]) -> None:
        """Learn from one verified tree: the drafter's delivery (nodes drafted of those planned),
        top-1 acceptance per reached level, and sibling gain."""
        o = self.options
        keep = self._keep
        planned = self._planned.pop(request_id, 0)
        if planned > 0:
            got = min(tree.size - 1, planned)
            s = self._state(request_id)
            s.got = (1 - o.ema) * s.got + o.ema * got
            s.want = (1 - o.ema) * s.want + o.ema * planned
            self._pop_got = keep * self._pop_got + (1 - keep) * got
            self._pop_want = keep * self._pop_want + (1 - keep) * planned
        if tree.size == 1:
            return
        self._shapes.clear()
        children: dict[int, list[int]] = {}
        for i, par in enumerate(tree.parents.tolist()[1:], start=1):
            children.setdefault(par, []).append(i)
        on_path = set(accepted_nodes)
        hits = trials = 0
        g_hits = g_trials = 0
        alpha = self.alpha(request_id)
        lvl_hits, lvl_reached, lvl_alpha, lvl_prior = self._level_stats(self._state(request_id).cls)
        for level, node in enumerate(accepted_nodes):
            kids = children.get(node, [])
            if not kids:
                continue
            hit = kids[0] in on_path
            if level == 0:  # alpha: the root's first child
                trials, hits = 1, int(hit)
            elif level < self.budget.max_depth:  # deeper levels: the class's level acceptance, over every request
                k = level - 1
                lvl_hits[k] = keep * lvl_hits[k] + (1 - keep) * hit
                lvl_reached[k] = keep * lvl_reached[k] + (1 - keep)
                lvl_alpha[k] = keep * lvl_alpha[k] + (1 - keep) * alpha
                lvl_prior[k] *= keep
            if hit:
                continue
            extra = kids[1:]
            won = next((j for j, c in enumerate(extra, start=1) if c in on_path), None)
            g_trials += won if won is not None else len(extra)
            g_hits += 1 if won is not None else 0
        if g_trials:
            self._gain_hits = keep * self._gain_hits + (1 - keep) * g_hits
            self._gain_trials = keep * self._gain_trials + (1 - keep) * g_trials
            self._gain_alpha = keep * self._gain_alpha + (1 - keep) * g_trials * self.alpha(request_id)
        if trials:
            s = self._state(request_id)
            acc, pop = self._acc(request_id), self._class_pop(s.cls)
            seen = s.seen.setdefault(s.cls, [0, 0])
            seen[0] += hits
            seen[1] += trials
            acc[0] = (1 - o.ema) * acc[0] + o.ema * hits
            acc[1] = (1 - o.ema) * acc[1] + o.ema * trials
            pop[0] = keep * pop[0] + (1 - keep) * hits
            pop[1] = keep * pop[1] + (1 - keep) * trials
            self._pop_hits = keep * self._pop_hits + (1 - keep) * hits
            self._pop_trials = keep * self._pop_trials + (1 - keep) * trials

    def observe_outcome(self, tokens: int, ms: float, branching: bool = False) -> None:
        """The last plan's outcome: ``tokens`` committed over all its requests in ``ms`` (drafting
        and the verify forward), compared with the rate the plan predicted: a speculative plan's
        feeds :meth:`outcome_factor` (that of steps with ``branching`` trees, or of chains only:
        what the drafter built, which a drafter of chains makes of any plan), a plain one's
        :meth:`plain_factor`."""
        pending, self._pending = self._pending, None
        if pending is None or not ms > 0 or self.options.outcome_ema == 0:
            return
        rate, rows, speculative, size = pending
        # what the plan predicted for the time the step took, within [1/4, 4] x what it got: a
        # first call's one-time costs (or one preempted step) must not outweigh the steps around it
        want = min(max(ms * rate, tokens / 4), tokens * 4)
        e, bucket = self.options.outcome_ema, batch_bucket(rows)
        ratios: dict = self._outcome if speculative else self._plain_outcome
        key = (bucket, branching, size) if speculative else bucket
        got0, want0 = ratios.get(key, (want, want))  # starts at ratio 1
        # each factor is bounded on one side where it is read, and credit from steps on the other
        # side fades with the EMA (~1 / outcome_ema steps): it cannot hold off a later veto for long
        ratios[key] = (got0 + e * (tokens - got0), want0 + e * (want - want0))

    def observe_plan_cost(self, rows: int, ms: float, planning_ms: float | None = None) -> None:
        """A step of ``rows`` requests whose plan drafted nothing cost ``ms`` beside the forward
        (planning, the drafter's lookups, verifying root-only trees), learned per batch size (EMA):
        a batch that the drafter's missing drafts hold back goes quiet while its plans earn less
        than that (:meth:`quiet`). ``planning_ms``: the part of it before the forward (the plan
        and the lookups, which a plan that drafts pays too, in its measured drafting): plain
        decoding after a plan is priced with it, so a plan's drafting is weighed by what it adds
        to the planning already paid (learned the same way; priced at 0 until reported)."""
        if not ms >= 0 or (planning_ms is not None and not 0 <= planning_ms <= ms):
            raise ValueError(f"observe_plan_cost({rows}, {ms}, {planning_ms}): 0 <= planning_ms <= ms needed")
        _ema_into(self._plan_cost, batch_bucket(rows), ms, self.options.ema)
        if planning_ms is not None:
            _ema_into(self._planning, batch_bucket(rows), planning_ms, self.options.ema)

    def observe_cycle(self, rows: int, ms: float, drafted: bool = False) -> None:
        """One step of ``rows`` requests spent ``ms`` outside its measured forward and drafting
        (the engine's sampling, bookkeeping and scheduling between forwards), learned per batch
        size (EMA) and apart for steps ``drafted`` (with drafts of their own or after a step
        with drafts: the engine prepares, verifies and rolls back more rows) and plain ones:
        plans that draft are ranked with the first paid per step, plain decoding's rate is taken
        with the second, so a step's fixed cost counts against the tokens it commits, and what
        drafts add to it against the drafts."""
        if not ms >= 0:
            raise ValueError(f"observe_cycle({rows}, {ms}): ms >= 0 needed")
        _ema_into(self._between, (batch_bucket(rows), bool(drafted)), ms, self.options.ema)

    def between_ms(self, rows: int, drafted: bool) -> float:
        """The learned time between forwards (:meth:`observe_cycle`) of a step of ``rows``
        requests with drafts (``drafted``) or without: the other kind's until this kind is
        measured at that batch size, 0 until either is."""
        bucket = batch_bucket(rows)
        return self._between.get((bucket, drafted), self._between.get((bucket, not drafted), 0.0))

    def observe_step(self, n_query_tokens: int, ms: float, kv: int | None = None, rows: int = 1) -> None:
        """Refine the cost model with one measured verify forward of ``rows`` requests (``kv``:
        as for :meth:`plan`)."""
        self.cost.observe(n_query_tokens, ms, kv, rows)

    def observe_draft(self, depth: int, nodes: int, ms: float, rows: int = 1) -> None:
        """Refine the drafting-cost model with one measured drafting step of ``rows`` drafting
        requests (skipped without nodes)."""
        if nodes > 0 and depth > 0:
            self.draft_cost.observe(depth, nodes, ms, max(rows, 1))

    def observe_branching(self, trees: int, ms: float) -> None:
        """One step's ``ms`` spent on its ``trees`` branching trees outside the target's forward
        (an engine's tree-attention pass beside its own kernel), learned per tree (EMA; the first
        timing, or the first after the price drifted while no tree was planned, taken whole): plans
        then price each branching tree above a chain of as many nodes, and weigh chains only against
        trees."""
        if trees <= 0 or not ms >= 0:
            raise ValueError(f"observe_branching({trees}, {ms}): trees > 0 and ms >= 0 needed")
        per, e = ms / trees, self.options.ema
        # the first timing, or one after the price drifted (_relax_branching), is taken whole
        fresh = self._branch_ms == 0 or self._branch_stale > self.options.probe_steps
        self._branch_ms = per if fresh else (1 - e) * self._branch_ms + e * per
        self._branch_stale = 0

    def observe_catch_up(self, positions: int, ms: float) -> None:
        """A drafter spent ``ms`` catching up ``positions`` committed positions (its state of
        requests that start drafting or resume). A catch-up runs the drafter's layer over those
        positions, which costs a fixed part plus a part per position; the fixed part is what the
        drafter pays on every drafting step anyway (it runs the same layer over the step's own
        positions, priced as drafting), so a plan pays only the part per position: the slope of a
        least-squares line through the catch-ups (EMAs of the moments, so a prompt's 64 positions
        and a resume's 8 both inform it). Until the catch-ups' sizes spread enough to tell slope
        from fixed part (a standard deviation of at least a quarter of their mean), and where the
        line falls (the sizes do not explain the times: noise) or rises faster than the ratio of
        the EMAs of ms and positions, it is that ratio, which bounds the slope from above when the
        fixed part is not negative."""
        if positions <= 0 or not ms >= 0:
            raise ValueError(f"observe_catch_up({positions}, {ms}): positions > 0 and ms >= 0 needed")
        e, x = self.options.ema, float(positions)
        if self._caught is None:
            mx, my, mxx, mxy = x, ms, x * x, x * ms
        else:
            mx, my, mxx, mxy = self._caught
            mx, my, mxx, mxy = mx + e * (x - mx), my + e * (ms - my), mxx + e * (x * x - mxx), mxy + e * (x * ms - mxy)
        self._caught = (mx, my, mxx, mxy)
        ratio, var = my / mx, mxx - mx * mx
        slope = (mxy - mx * my) / var if 16 * var >= mx * mx else ratio
        self._catch_ms = slope if 0 <= slope <= ratio else ratio

    @property
    def catch_ms(self) -> float:
        """The learned ms a plan pays per position a drafter catches up (0 until one is
        reported; :meth:`observe_catch_up`)."""
        return self._catch_ms

    @property
    def branch_ms(self) -> float:
        """The learned extra ms per branching tree (0 until an engine reports one)."""
        return self._branch_ms

    def release(self, request_id: Hashable) -> None:
        """Forget a finished request; its first-draft hits and trials per evidence class join
        the class's dispersion (how much requests differ there)."""
        s = self._requests.pop(request_id, None)
        if s is not None:
            o = self.options
            for cls, (hits, trials) in s.seen.items():  # weighed at most as the population's memory
                self._dispersion.setdefault(cls, Dispersion(self._keep, 4 / o.ema)).add(hits, trials)
        self._planned.pop(request_id, None)

    def predicted_rate(self, request_ids: Sequence[Hashable], plans: Sequence[Plan], kv: int | None = None) -> float:
        """Predicted committed tokens per millisecond of ``plans`` (for logs and tests)."""
        nodes, expected, depth, no_tree, drafting = 0, float(len(plans)), 0, 1.0, 0
        branching = sum(p.mode == "tree" for p in plans)
        for rid, p in zip(request_ids, plans):
            if p.max_nodes:
                drafting += 1
                e, _ = self.expected_table(self.alpha(rid), self.delivery(rid), self._state(rid).cls)
                nodes += p.max_nodes
                expected += float(e[p.max_nodes])
                depth = max(depth, p.max_depth)
                no_tree *= 1.0 - self.delivery(rid)
        tokens = self._verify_tokens(len(plans), nodes, max((p.max_nodes for p in plans), default=0))
        b = len(plans)
        forward = (1.0 - no_tree) * self.cost(tokens, kv, b) + no_tree * self.cost(b, kv, b)
        return expected / (forward + self.draft_cost(depth, nodes, drafting) + self._branch_ms * branching)


#: the longest wait between probes (steps without speculation), however many found nothing
_PROBE_MAX = 1024
_QUIET_MAX = 64  # the longest quiet spell (steps)


def size_class(nodes: int) -> int:
    """A plan's size class for the outcome check: 0 without drafts, then 1, 2-3, 4-7, 8-15, ...
    draft nodes in its largest tree (``nodes.bit_length()``)."""
    return max(int(nodes), 0).bit_length()


def _ema_into(store: dict[Any, float], bucket: Hashable, x: float, weight: float) -> None:
    """``store[bucket]``, an EMA per batch size (or per key of it), moved toward ``x`` by
    ``weight`` (``x`` itself at the first observation)."""
    seen = store.get(bucket)
    store[bucket] = x if seen is None else seen + weight * (x - seen)


def _factor(own: float | None, ratios: Iterable[float], bound: float) -> float:
    """The outcome factor of a class measured at ``own`` (``None``: not yet, 1.0) among the
    bucket's ``ratios``: ``own`` within ``[1 / bound, 1]``, and never above the best class's
    factor times ``own`` over the best ratio (the worse class keeps its measured shortfall
    against the better one: with both below the bound, the bound alone would rank them alike).
    The best ratio counts at most 1: a class measured above its prediction vetoes nothing (a
    rarely planned class's noise once read 1.15 and scaled every other class down by that)."""
    if own is None:
        return 1.0
    best = min(max(max(ratios, default=own), own), 1.0)
    return min(max(own, 1 / bound), 1.0, max(best, 1 / bound) * own / best)


def _served_steps(remaining: int | None, cap: int) -> int:
    """The steps a request's catch-up serves: its remaining tokens over 2 (a speculating step
    commits about two), at least 1 and at most ``cap`` (``cap`` when unknown)."""
    return cap if remaining is None else min(max(remaining // 2, 1), cap)


def _slack(remaining: Sequence[int | None] | None, batch: int) -> np.ndarray:
    """Per request, the most tokens left in the batch over its own (1: it sets the batch's pace;
    an unknown count is taken for the most): how far below the batch's pace it may fall."""
    left = [None] * batch if remaining is None else list(remaining)
    known = [n for n in left if n is not None]
    most = max(known, default=1)
    return np.array([most / max(n, 1) if n is not None else 1.0 for n in left], dtype=np.float64)
