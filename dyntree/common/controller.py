"""Adaptive speculation controller: how much to speculate, per request and per batch.

* Per request, an EMA of the top-1 draft acceptance ``alpha`` (the chance that the root's first
  child is accepted) and a global *sibling gain* ``g`` (what an extra
  sibling is worth relative to an independent first draft: 0 nothing, 1 as much) predict the
  expected accepted draft tokens of a tree with ``n`` nodes and depth ``d``: with ``w = n / d``
  nodes per level, level ``j``'s acceptance ``alpha_j = alpha * r_j`` (``r_j``, the *depth
  profile*: the hits observed at that level over those the requests' own alpha predicted, so
  Hydra's weaker later heads make its trees shallower) and ``beta_j = 1 - (1 - alpha_j)^(1 + g (w - 1))``,
  ``E(n, d) = beta_1 + beta_1 beta_2 + ... + beta_1 ... beta_d``, times the request's *delivery* (the EMA fraction
  of planned nodes the drafter actually drafted: n-gram lookup often finds nothing); the best
  depth is chosen per ``n``; a verify is priced as wide as planned only with the chance that
  some planned tree arrives, else as plain decoding. ``g`` is fitted online from how often later
  siblings catch the token a first child missed. A request that keeps being accepted gets deep,
  large trees; one that keeps failing gets a short chain or nothing (each draft node must be
  worth ``min_node_value`` accepted tokens), and drifts back toward the prior (and full delivery)
  while idle so it is retried now and then.
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
  (ms vs. tree depth and batch draft nodes) starts from the ``draft_ms_*`` options and is fitted
  online to the measured drafting time of each step (tree building included), so a drafter
  whose overhead eats the gain is turned down. When a forward's cost grows in proportion to its
  tokens (compute-bound, high batch) no prefix pays and every request decodes plainly.
* The outcome check: what each speculative step really committed per measured millisecond
  (drafting and verify) over what its plan predicted, as an EMA kept per batch size (a
  power-of-two bucket); below 1 it scales speculative plans' predicted rates down
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
  prices a plain step of 16 requests. At batch 16 against ~800 cached tokens that priced plain
  steps 10-15% dearer than they ran, and Hydra's one-node trees, predicted to pay 10-15%, lost
  ~12%. A plain step slower than predicted never lowers the bar: a comparison with plain steps
  taken while the cost model still learned a new batch shape once made speculation look better
  than plain decoding at batch 13 (0.92x).
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass
from typing import Callable, Hashable, Literal, Mapping, Sequence

from dyntree.common.options import ControllerOptions
from dyntree.common.tree import DraftTree

__all__ = ["Plan", "CostModel", "DraftCost", "SpeculationController"]


@dataclass(frozen=True)
class Plan:
    """What one request should draft this step (``none``: plain decoding, a root-only tree)."""

    mode: Literal["none", "chain", "tree"]
    max_nodes: int
    max_depth: int


class CostModel:
    """Milliseconds of one target forward as a piecewise-linear function of its query tokens,
    plus attention over the cached tokens.

    Between measured sizes the cost is interpolated; below the smallest it is that size's cost;
    above the largest the last segment is extended (with one point: proportional to tokens). The
    knots hold one request's forwards against ``kv_ref`` cached tokens; a forward of ``rows``
    requests against ``kv`` cached tokens each adds ``(kv - kv_ref) * (attn_ms * tokens + row_ms *
    rows)``. Attention computes with every cached token for every query token (``attn_ms``), and
    reads every request's cached keys and values once, however many query tokens the request has
    (``row_ms``: memory-bound). On a 2-core CPU with SmolLM2 in fp32, timed at start-up, the first
    is 0.5-2.2 us per pair and the second 2.6-3.4 us per request and cached token: 12 requests x 1
    token against 800 cached tokens spend ~45 ms of a forward in attention, one request x 8 tokens
    against 300 ~3 ms (30 layers x 100 us), though both are just query tokens to the knots. Without
    the row term the knots learned the batch's attention as the cost of any forward of that many
    tokens, so wider verifies looked free.
    """

    def __init__(self, points: Mapping[int, float] | Sequence[tuple[int, float]], lr: float = 0.2,
                 attn_ms: float = 0.0, kv_ref: int = 0, row_ms: float = 0.0) -> None:
        items = sorted(dict(points).items())
        if not items:
            raise ValueError("CostModel needs at least one (n_tokens, ms) point")
        for n, ms in items:
            if n < 1 or not ms > 0:
                raise ValueError(f"CostModel point ({n}, {ms}): n_tokens must be >= 1 and ms > 0")
        self.xs = [int(n) for n, _ in items]
        self.ys = [float(ms) for _, ms in items]
        self._monotone()
        if not attn_ms >= 0 or not row_ms >= 0 or kv_ref < 0:
            raise ValueError(f"CostModel: attn_ms ({attn_ms}), row_ms ({row_ms}) and kv_ref ({kv_ref}) must be >= 0")
        self.lr = lr
        self.attn_ms, self.row_ms, self.kv_ref = float(attn_ms), float(row_ms), int(kv_ref)
        self._unseen = False  # set by :meth:`online`: the first observation sets every knot

    @classmethod
    def online(cls, sizes: Sequence[int], lr: float = 0.2) -> "CostModel":
        """A model learned from the engine's own forwards, for engines that cannot time dummy
        forwards up front: the first observed forward sets every knot (a flat cost: an optimistic
        start for wide verifies, which the next observations correct), then :meth:`observe` refines
        the knots near each observed size."""
        model = cls({int(n): 1.0 for n in sizes}, lr)
        model._unseen = True
        return model

    @classmethod
    def measure(
        cls, forward: Callable[[int], object], sizes: Sequence[int], repeats: int = 5, lr: float = 0.2,
        kv_forward: Callable[[int, int, int], object] | None = None, kv_ref: int = 0, kv_long: int = 0,
        rows: int = 8,
    ) -> "CostModel":
        """Time ``forward(n)`` (which must block until the forward is done) at each size, against
        ``kv_ref`` cached tokens. With ``kv_forward(r, n, kv)`` (a forward of ``r`` requests x
        ``n`` query tokens against ``kv`` cached tokens each) also fit the attention terms: one
        request x the largest size below 64 and ``rows`` requests x 1 token, each against
        ``kv_ref`` and ``kv_long`` cached tokens; the first difference is ``row_ms + n * attn_ms``
        per extra cached token, the second ``rows * (row_ms + attn_ms)``.

        Each size keeps its fastest of ``repeats`` timings, taken in interleaved rounds over all
        sizes: noise only ever adds time, and a slow spell of a shared machine then has to hit one
        size in every round to distort it (timed back to back, one spell priced 2- and 4-token
        verifies at 1.6x a 1-token step on a CPU where they cost 1.05x, and the controller hardly
        speculated for a whole run)."""
        timed: list[Callable[[], object]] = [lambda n=int(n): forward(n) for n in sizes]
        n_long = max((int(m) for m in sizes if m < 64), default=min(int(m) for m in sizes))
        probe = kv_forward is not None and kv_long > kv_ref and n_long > 1 and rows > 1
        if probe:
            assert kv_forward is not None
            timed += [lambda r=r, n=n, kv=kv: kv_forward(r, n, kv)
                      for r, n in ((1, n_long), (rows, 1)) for kv in (kv_ref, kv_long)]
        best = _fastest_ms(timed, repeats)
        points = dict(zip((int(n) for n in sizes), best[: len(sizes)]))
        attn = row = 0.0
        if probe:
            span = kv_long - kv_ref
            per_token = max(best[-3] - best[-4], 0.0) / span  # row_ms + n_long * attn_ms
            per_row = max(best[-1] - best[-2], 0.0) / (rows * span)  # row_ms + attn_ms
            attn = max(per_token - per_row, 0.0) / (n_long - 1)
            row = max(per_row - attn, 0.0)
        return cls(points, lr, attn, kv_ref, row)

    def copy(self) -> "CostModel":
        """An independent copy (knots, attention term, learning rate)."""
        model = CostModel(list(zip(self.xs, self.ys)), self.lr, self.attn_ms, self.kv_ref, self.row_ms)
        model._unseen = self._unseen
        return model

    def _monotone(self) -> None:
        for i in range(1, len(self.ys)):
            self.ys[i] = max(self.ys[i], self.ys[i - 1])

    def _segment(self, n: float) -> tuple[int, float]:
        """Left knot index and the weight of the right knot for ``n`` (clamped)."""
        xs = self.xs
        if len(xs) == 1 or n <= xs[0]:
            return 0, 0.0
        i = min(bisect.bisect_right(xs, n) - 1, len(xs) - 2)
        return i, (n - xs[i]) / (xs[i + 1] - xs[i])

    def __call__(self, n_tokens: float, kv: int | None = None, rows: int = 1) -> float:
        """Predicted ms of a forward of ``n_tokens`` query tokens from ``rows`` requests, each
        against ``kv`` cached tokens (``None``: ``kv_ref``, the knots' own)."""
        xs, ys = self.xs, self.ys
        if len(xs) == 1:
            base = ys[0] * max(n_tokens, xs[0]) / xs[0]
        else:
            i, w = self._segment(n_tokens)
            base = ys[i] + w * (ys[i + 1] - ys[i])  # w > 1 extends the last segment
        return base + self._attention(n_tokens, kv, rows, base)

    def _attention(self, n_tokens: float, kv: int | None, rows: int, base: float) -> float:
        """The attention terms: ms beyond (or, with fewer cached tokens, short of) the knots'."""
        if kv is None or not (self.attn_ms or self.row_ms):
            return 0.0
        return max((kv - self.kv_ref) * (self.attn_ms * n_tokens + self.row_ms * rows), -0.5 * base)

    def observe(self, n_tokens: int, ms: float, kv: int | None = None, rows: int = 1) -> None:
        """Move the knots toward one measured forward (``ms`` for ``n_tokens`` query tokens of
        ``rows`` requests against ``kv`` cached tokens each; the attention terms are taken as
        measured)."""
        if n_tokens < 1 or not ms > 0:
            raise ValueError(f"observe({n_tokens}, {ms}): n_tokens must be >= 1 and ms > 0")
        if self._unseen:
            self.ys, self._unseen = [float(ms)] * len(self.xs), False
            return
        err = ms - self(n_tokens, kv, rows)
        i, w = self._segment(n_tokens)
        if len(self.xs) == 1:
            self.ys[0] += self.lr * err * self.xs[0] / max(n_tokens, self.xs[0])
        else:
            w = min(w, 1.0)
            self.ys[i] += self.lr * (1 - w) * err
            self.ys[i + 1] += self.lr * w * err
        self.ys = [max(y, 1e-6) for y in self.ys]
        self._monotone()


def _fastest_ms(calls: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """The fastest wall-clock ms of each call over ``repeats`` rounds that time every call once
    (in order), after one warm-up call each."""
    for call in calls:
        call()
    best = [math.inf] * len(calls)
    for _ in range(max(repeats, 1)):
        for i, call in enumerate(calls):
            t0 = time.perf_counter()
            call()
            best[i] = min(best[i], (time.perf_counter() - t0) * 1e3)
    return best


class DraftCost:
    """Milliseconds of one drafting step as ``a + b * depth + c * nodes + e * depth * rows``,
    learned online.

    ``depth`` is the deepest tree of the step, ``nodes`` the draft nodes of the whole batch and
    ``rows`` the requests that draft (a drafter that runs a forward per depth, such as the
    quantized self-draft, pays per depth for every drafting request: measured ~13 ms per depth
    for one request and ~54 for four on a 2-core CPU). Exponentially forgetting least squares,
    regularised toward the prior coefficients (the ``draft_ms_*`` options), so it starts from them
    and follows the measured drafter (including tree building) as steps are observed;
    coefficients are kept non-negative.
    """

    def __init__(self, prior: Sequence[float], forget: float = 0.98, prior_weight: float = 1.0) -> None:
        if len(prior) != 4 or any(not c >= 0 for c in prior):
            raise ValueError(f"DraftCost prior must be 4 non-negative coefficients, got {prior}")
        # plain floats: a 4 x 4 solve per step costs less in Python than in tensor-op dispatch
        self.prior = tuple(float(c) for c in prior)
        self.forget, self.prior_weight = forget, prior_weight
        self._xx = [[0.0] * 4 for _ in range(4)]
        self._xy = [0.0] * 4
        self.coef = self.prior

    def __call__(self, depth: int, nodes: int, rows: int = 1) -> float:
        if nodes <= 0:
            return 0.0
        a, b, c, e = self.coef
        return a + b * depth + c * nodes + e * depth * rows

    def observe(self, depth: int, nodes: int, ms: float, rows: int = 1) -> None:
        """One measured drafting step (``nodes`` > 0, ``rows`` >= 1 requests drafting)."""
        if nodes <= 0 or depth <= 0 or rows <= 0 or not ms >= 0:
            raise ValueError(f"DraftCost.observe({depth}, {nodes}, {ms}, {rows}): depth, nodes, rows > 0 and "
                             "ms >= 0 needed")
        x, f, w = (1.0, float(depth), float(nodes), float(depth * rows)), self.forget, self.prior_weight
        self._xx = [[f * v + xi * xj for v, xj in zip(row, x)] for row, xi in zip(self._xx, x)]
        self._xy = [f * v + xi * ms for v, xi in zip(self._xy, x)]
        ridged = [[v + (w if i == j else 0.0) for j, v in enumerate(row)] for i, row in enumerate(self._xx)]
        coef = _solve(ridged, [v + w * p for v, p in zip(self._xy, self.prior)])
        self.coef = tuple(max(c, 0.0) for c in coef)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """``x`` with ``a x = b`` for a small non-singular ``a`` (Gaussian elimination, partial pivoting)."""
    n = len(b)
    m = [row[:] + [v] for row, v in zip(a, b)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            k = m[r][col] / m[col][col]
            m[r] = [v - k * p for v, p in zip(m[r], m[col])]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


@dataclass
class _RequestState:
    hits: float
    trials: float
    got: float  # decayed draft nodes delivered ...
    want: float  # ... of the nodes planned (the drafter's delivery ratio is got / want)


class SpeculationController:
    """Decides per step and per request: no speculation, a chain, or a tree with ``(N, D)``."""

    def __init__(self, cost: CostModel, options: ControllerOptions | None = None, padded: bool = False) -> None:
        self.cost = cost
        self.padded = padded
        self.options = options or ControllerOptions()
        o = self.options
        self.draft_cost = DraftCost((o.draft_ms_fixed, o.draft_ms_per_depth, o.draft_ms_per_node,
                                     o.draft_ms_per_depth_row))
        self._requests: dict[Hashable, _RequestState] = {}
        # Population acceptance (decayed hits, trials over every request): where a new request
        # starts, so a drafter that is good (or bad) for this workload is priced as such from a
        # request's first step.
        self._pop_hits = o.alpha_prior * o.prior_weight
        self._pop_trials = o.prior_weight
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
        # decayed hits and the hits the requests' own alpha predicted: how acceptance changes with
        # depth (Hydra's later heads are weaker; an n-gram match that held once tends to hold on),
        # measured against each request's own rate, so the good requests that alone reach deep
        # levels do not make deep levels look good. Each level's prior (``prior_weight`` predicted
        # hits, decaying as the level is observed) is the level above's ratio, so a level that is
        # rarely reached is not taken for as good as the root.
        self._lvl_hits = [0.0] * o.max_depth
        self._lvl_expected = [0.0] * o.max_depth
        self._lvl_prior = [o.prior_weight] * o.max_depth
        # expected_table and its hull steps, by rounded inputs
        self._tables: dict[tuple, tuple[tuple[list[float], list[int]], list[tuple[float, int, int]]]] = {}
        # The outcome check, per batch size (rounded down to a power of two): EMAs of the tokens
        # speculative steps committed and of the tokens their plans predicted for the time they
        # took. Their ratio, below 1, scales a speculative plan's predicted rate down for whatever
        # the models miss (a verify shape the cost model prices too cheaply, an optimistic
        # acceptance). A ratio of EMAs, not an EMA of per-step ratios: a step's tokens are random
        # (1 or 7 where 3 were expected), and an EMA of ratios kept at most 1 sat below 1 on
        # noise alone.
        self._outcome: dict[int, tuple[float, float]] = {}  # bucket -> (got, predicted)
        # The same for plain steps: a plain step faster than its prediction raises the bar that
        # speculation must clear (plain_factor).
        self._plain_outcome: dict[int, tuple[float, float]] = {}
        self._pending: tuple[float, int, bool] | None = None  # the last plan: (predicted rate, rows, speculative)

    # -- estimates ------------------------------------------------------------------------------
    def _state(self, rid: Hashable) -> _RequestState:
        o = self.options
        if rid not in self._requests:
            self._requests[rid] = _RequestState(self.population_alpha * o.prior_weight, o.prior_weight,
                                                self._pop_got / self._pop_want * o.prior_weight, o.prior_weight)
        return self._requests[rid]

    @property
    def population_alpha(self) -> float:
        """Top-1 acceptance over all requests seen (``alpha_prior`` before any): a new request's
        starting estimate."""
        return self._pop_hits / self._pop_trials

    def alpha(self, request_id: Hashable) -> float:
        """Current top-1 acceptance estimate of a request."""
        s = self._state(request_id)
        return s.hits / s.trials

    def delivery(self, request_id: Hashable) -> float:
        """Expected fraction of planned draft nodes the drafter delivers for a request."""
        s = self._state(request_id)
        return s.got / s.want

    @property
    def depth_profile(self) -> list[float]:
        """Per tree level, observed top-1 hits over the hits the requests' alpha predicted (1.0
        at the root, whose first child alpha is; a level with little evidence leans on the level
        above it)."""
        profile, above = [], 1.0
        for h, e, p in zip(self._lvl_hits, self._lvl_expected, self._lvl_prior):
            above = (h + p * above) / (e + p)
            profile.append(above)
        return profile

    @staticmethod
    def _bucket(rows: int) -> int:
        """The outcome check's batch-size bucket: ``rows`` rounded down to a power of two."""
        return 1 << (max(rows, 1).bit_length() - 1)

    def outcome_factor(self, rows: int = 1) -> float:
        """At batches of ``rows`` requests, the measured over predicted throughput of speculative
        steps (1.0 until observed): what a speculative plan's predicted rate is multiplied by,
        within ``[1 / outcome_bound, 1]``. It only ever vetoes: a measured rate above the
        prediction does not talk the planner into speculation its models say does not pay."""
        got, want = self._outcome.get(self._bucket(rows), (1.0, 1.0))
        return min(max(got / want, 1 / self.options.outcome_bound), 1.0)

    def plain_factor(self, rows: int = 1) -> float:
        """At batches of ``rows`` requests, the measured over predicted throughput of plain steps
        (1.0 until observed), within ``[1, outcome_bound]``: what plain decoding's predicted rate
        is multiplied by where speculation is compared with it. It only ever raises the bar: a
        plain step slower than predicted does not talk the planner into speculation."""
        got, want = self._plain_outcome.get(self._bucket(rows), (1.0, 1.0))
        return min(max(got / want, 1.0), self.options.outcome_bound)

    @property
    def sibling_gain(self) -> float:
        """Fitted ``g``: extra-sibling catch rate ``c = 1 - (1 - alpha)^g`` solved for ``g``."""
        catch = min(self._gain_hits / self._gain_trials, 1 - 1e-9)
        log_miss = math.log1p(-min(self._gain_alpha / self._gain_trials, 1 - 1e-9))
        if log_miss > -1e-9:
            return self.options.sibling_gain_prior
        return min(max(math.log1p(-catch) / log_miss, 0.0), 1.0)

    def expected_table(self, alpha: float, delivery: float = 1.0) -> tuple[list[float], list[int]]:
        """``(E[n], best_depth[n])`` for ``n = 0..max_nodes`` draft nodes at acceptance ``alpha``
        (scaled per level by :attr:`depth_profile`), times ``delivery``, the fraction of planned
        nodes the drafter actually drafts (an n-gram drafter finds no match about half the time:
        its plans are worth half as much).

        Plain Python floats: the table is small (``max_nodes x max_depth``), where tensor ops
        would cost more in dispatch than in math. Tables are kept by their inputs rounded to 0.01
        (alpha, delivery, the profile and the sibling gain): every request's alpha moves every
        step it drafts, and a batch of 8 recomputed ~8 tables a step at a 0.001 grain (1.1 ms of
        planning a step); a delivery only scales a table (the best depth does not change)."""
        return self._table(alpha, delivery)[0]

    def _table(self, alpha: float, delivery: float) -> tuple[tuple[list[float], list[int]], list[tuple[float, int, int]]]:
        """:meth:`expected_table` and the steps of its upper concave hull (:meth:`_hull`), cached."""
        o = self.options
        if o.max_depth == 0:
            return ([0.0] * (o.max_nodes + 1), [0] * (o.max_nodes + 1)), []
        gain, profile = round(self.sibling_gain, 2), tuple(round(r, 2) for r in self.depth_profile)
        base_key = (round(alpha, 2), 1.0, gain, profile)
        key = (base_key[0], round(delivery, 2), gain, profile)
        entry = self._tables.get(key)
        if entry is None:
            if len(self._tables) >= 4096:
                self._tables.clear()
            base = self._tables.get(base_key)
            if base is None:
                e, depth = self._expected(base_key[0], gain, profile)
                base = self._tables[base_key] = ((e, depth), self._hull(e))
            if key == base_key:
                return base
            e, depth = base[0]
            scaled = [key[1] * x if x >= 0 else -1.0 for x in e]
            entry = self._tables[key] = ((scaled, depth), self._hull(scaled))
        return entry

    def _expected(self, alpha: float, gain: float, profile: Sequence[float]) -> tuple[list[float], list[int]]:
        """:meth:`expected_table` computed at full delivery: a tree of ``n`` nodes and depth ``d``
        has ``n / d`` nodes per level; level ``j`` catches the target's token with ``beta_j = 1 -
        (1 - alpha_j)^(1 + g (n / d - 1))``, and ``E = beta_1 + beta_1 beta_2 + ...`` (-1: no such
        tree)."""
        o = self.options
        miss = [1 - min(max(alpha * r, 0.0), 1 - 1e-9) for r in profile]
        best, depth = [0.0], [0]
        for n in range(1, o.max_nodes + 1):
            e_best, d_best = -1.0, 0  # -1: no such tree
            for d in range(1, min(n, o.max_depth) + 1):
                if not o.allow_trees and d != n:
                    continue
                expo = 1 + gain * (max(n / d, 1.0) - 1)
                e, reach = 0.0, 1.0
                for j in range(d):
                    reach *= 1 - miss[j] ** expo
                    e += reach
                if e > e_best:
                    e_best, d_best = e, d
            best.append(e_best)
            depth.append(d_best)
        return best, depth

    # -- planning -------------------------------------------------------------------------------
    def plan(self, request_ids: Sequence[Hashable], kv: int | None = None) -> list[Plan]:
        """One plan per live request for the next verify step; ``kv``: the cached tokens each
        query row of the verify attends to (one rectangular cache: the longest request's), priced by
        the cost model's attention term."""
        o = self.options
        b = len(request_ids)
        if b == 0:
            return []
        keys = [(self.alpha(r), self.delivery(r)) for r in request_ids]
        cache = {key: self._table(*key) for key in set(keys)}
        tables = [cache[k][0] for k in keys]
        # Segments of each request's upper concave hull: (gain per token, request, n_from, n_to).
        segments = [(gain, r, lo, hi) for r, k in enumerate(keys) for gain, lo, hi in cache[k][1]]
        segments.sort(key=lambda s: (-s[0], s[1], s[2]))
        cost = self.cost
        plain_ms = cost(b, kv, b)
        plain = b / plain_ms
        raise_bar = self.plain_factor(b)
        bar = plain * raise_bar  # what plain decoding delivers, as measured
        # the two checks together move a plan by at most outcome_bound, as each does alone
        factor = max(self.outcome_factor(b), raise_bar / o.outcome_bound)
        best_rate, best_k = bar, 0
        nodes, widest, expected, max_depth, drafting = 0, 0, float(b), 0, 0
        no_tree = 1.0  # chance that no planned tree is delivered (the forward is then plain)
        for k, (_, r, lo, hi) in enumerate(segments, start=1):
            tokens = self._verify_tokens(b, nodes + hi - lo, max(widest, hi))
            if tokens > o.max_batch_tokens:
                break
            nodes, widest = nodes + hi - lo, max(widest, hi)
            expected += float(tables[r][0][hi] - tables[r][0][lo])
            max_depth = max(max_depth, int(tables[r][1][hi]))
            if lo == 0:  # this request's first segment: its tree arrives with its delivery ratio
                no_tree *= 1.0 - keys[r][1]
                drafting += 1
            forward = (1.0 - no_tree) * cost(tokens, kv, b) + no_tree * plain_ms
            rate = factor * expected / (forward + self.draft_cost(max_depth, nodes, drafting))
            if rate > best_rate:
                best_rate, best_k = rate, k
        alloc = [0] * b
        for _, r, lo, hi in segments[:best_k]:
            alloc[r] = hi
        speculate = best_k > 0 and best_rate >= bar * o.min_gain
        if not speculate:
            alloc = [0] * b
            # idle: the speculative outcome drifts back toward 1, so a bad spell (or a cost model
            # that was wrong and has learned since) does not end speculation at this batch size
            bucket = self._bucket(b)
            if bucket in self._outcome:
                got, want = self._outcome[bucket]
                self._outcome[bucket] = (got + o.outcome_relax * (want - got), want)
        self._pending = (best_rate / factor, b, True) if speculate else (plain, b, False)
        plans = []
        for r, (rid, n) in enumerate(zip(request_ids, alloc)):
            self._planned[rid] = n
            if n == 0:
                # idle: no evidence, so drift back toward the better of the population's
                # acceptance and the prior (and toward full delivery) until a short probe pays
                # again (one unlucky step must not end a good drafter's speculation for the rest
                # of a request)
                s = self._state(rid)
                s.hits += o.relax * (max(self.population_alpha, o.alpha_prior) * s.trials - s.hits)
                s.got += o.relax * (s.want - s.got)
                plans.append(Plan("none", 0, 0))
            else:
                d = int(tables[r][1][n])
                plans.append(Plan("chain" if d == n else "tree", n, d))
        return plans

    def _verify_tokens(self, batch: int, nodes: int, widest: int) -> int:
        """Query tokens of the verify forward: roots plus draft nodes, or, for an engine that
        pads every tree of the batch to the widest (``padded``), ``batch x (1 + widest)``."""
        return batch * (1 + widest) if self.padded else batch + nodes

    def _hull(self, e: list[float]) -> list[tuple[float, int, int]]:
        """Upper-concave-hull steps ``(gain per node, n_from, n_to)`` of ``E[n]`` worth taking."""
        o = self.options
        steps, n = [], 0
        while n < o.max_nodes:
            gains = [(e[m] - e[n]) / (m - n) if e[m] >= 0 else -1.0 for m in range(n + 1, o.max_nodes + 1)]
            j = max(range(len(gains)), key=gains.__getitem__)  # first of the largest
            if gains[j] < o.min_node_value:
                break
            steps.append((gains[j], n, n + j + 1))
            n = n + j + 1
        return steps

    # -- feedback -------------------------------------------------------------------------------
    def observe(self, request_id: Hashable, tree: DraftTree, accepted_nodes: Sequence[int]) -> None:
        """Learn from one verified tree: the drafter's delivery (nodes drafted of those planned),
        top-1 acceptance per reached level, and sibling gain."""
        o = self.options
        keep = 1 - o.ema / 4  # population statistics: batch-wide, slowly moving
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
        children: dict[int, list[int]] = {}
        for i, par in enumerate(tree.parents.tolist()[1:], start=1):
            children.setdefault(par, []).append(i)
        on_path = set(accepted_nodes)
        hits = trials = 0
        g_hits = g_trials = 0
        predicted = self.alpha(request_id)
        for level, node in enumerate(accepted_nodes):
            kids = children.get(node, [])
            if not kids:
                continue
            hit = kids[0] in on_path
            if level == 0:  # alpha: the root's first child
                trials, hits = 1, int(hit)
            elif level < o.max_depth:  # deeper levels: the depth profile, against that alpha
                self._lvl_hits[level] = keep * self._lvl_hits[level] + (1 - keep) * hit
                self._lvl_expected[level] = keep * self._lvl_expected[level] + (1 - keep) * predicted
                self._lvl_prior[level] *= keep
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
            s.hits = (1 - o.ema) * s.hits + o.ema * hits
            s.trials = (1 - o.ema) * s.trials + o.ema * trials
            self._pop_hits = keep * self._pop_hits + (1 - keep) * hits
            self._pop_trials = keep * self._pop_trials + (1 - keep) * trials

    def observe_outcome(self, tokens: int, ms: float) -> None:
        """The last plan's outcome: ``tokens`` committed over all its requests in ``ms`` (drafting
        and the verify forward), compared with the rate the plan predicted: a speculative plan's
        feeds :meth:`outcome_factor`, a plain one's :meth:`plain_factor`."""
        pending, self._pending = self._pending, None
        if pending is None or not ms > 0 or self.options.outcome_ema == 0:
            return
        rate, rows, speculative = pending
        # what the plan predicted for the time the step took, within [1/4, 4] x what it got: a
        # first call's one-time costs (or one preempted step) must not outweigh the steps around it
        want = min(max(ms * rate, tokens / 4), tokens * 4)
        e, bucket = self.options.outcome_ema, self._bucket(rows)
        ratios = self._outcome if speculative else self._plain_outcome
        got0, want0 = ratios.get(bucket, (want, want))  # starts at ratio 1
        # each factor is bounded on one side where it is read, and credit from steps on the other
        # side fades with the EMA (~1 / outcome_ema steps): it cannot hold off a later veto for long
        ratios[bucket] = (got0 + e * (tokens - got0), want0 + e * (want - want0))

    def observe_step(self, n_query_tokens: int, ms: float, kv: int | None = None, rows: int = 1) -> None:
        """Refine the cost model with one measured verify forward of ``rows`` requests (``kv``:
        as for :meth:`plan`)."""
        self.cost.observe(n_query_tokens, ms, kv, rows)

    def observe_draft(self, depth: int, nodes: int, ms: float, rows: int = 1) -> None:
        """Refine the drafting-cost model with one measured drafting step of ``rows`` drafting
        requests (skipped without nodes)."""
        if nodes > 0 and depth > 0:
            self.draft_cost.observe(depth, nodes, ms, max(rows, 1))

    def release(self, request_id: Hashable) -> None:
        self._requests.pop(request_id, None)
        self._planned.pop(request_id, None)

    def predicted_rate(self, request_ids: Sequence[Hashable], plans: Sequence[Plan], kv: int | None = None) -> float:
        """Predicted committed tokens per millisecond of ``plans`` (for logs and tests)."""
        nodes, expected, depth, no_tree, drafting = 0, float(len(plans)), 0, 1.0, 0
        for rid, p in zip(request_ids, plans):
            if p.max_nodes:
                drafting += 1
                e, _ = self.expected_table(self.alpha(rid), self.delivery(rid))
                nodes += p.max_nodes
                expected += float(e[p.max_nodes])
                depth = max(depth, p.max_depth)
                no_tree *= 1.0 - self.delivery(rid)
        tokens = self._verify_tokens(len(plans), nodes, max((p.max_nodes for p in plans), default=0))
        b = len(plans)
        forward = (1.0 - no_tree) * self.cost(tokens, kv, b) + no_tree * self.cost(b, kv, b)
        return expected / (forward + self.draft_cost(depth, nodes, drafting))
