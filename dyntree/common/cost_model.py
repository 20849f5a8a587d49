"""What a step costs, learned: the target's forward as a function of its query tokens
(:class:`CostModel`) and the drafter's step as a function of tree depth and batch nodes
(:class:`DraftCost`, one per class of drafting requests: :class:`DraftCosts`). The adaptive
controller (:mod:`dyntree.common.controller`) prices plans with them; engines seed a
:class:`CostModel` from their own timed forwards (:meth:`CostModel.measure`) or learn it online
(:meth:`CostModel.online`).
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from typing import Callable, Mapping, Sequence, overload

import numpy as np

__all__ = ["CostModel", "DraftCost", "DraftCosts", "batch_bucket", "knot_sizes"]


class CostModel:
    """Milliseconds of one target forward as a piecewise-linear function of its query tokens,
    plus attention over the cached tokens.

    Between measured sizes the cost is interpolated; below the smallest it is that size's cost;
    above the largest the last segment is extended (with one point: proportional to tokens). The
    knots are read as measured and learned, not made non-decreasing: a CPU forward can cost more
    at 2 query tokens than at 3-5 (vLLM's CPU backend at batch 1), and a non-decreasing read
    priced every verify from 2 to 8 tokens at the 2-token knot, while the knots below that
    envelope, whose reads no observation could move, fell step after step. The
    knots hold one request's forwards against ``kv_ref`` cached tokens; a forward of ``rows``
    requests against ``kv`` cached tokens each adds ``(kv - kv_ref) * (attn_ms * tokens + row_ms *
    rows)``. Attention computes with every cached token for every query token (``attn_ms``), and
    reads every request's cached keys and values once, however many query tokens the request has
    (``row_ms``: memory-bound): a batch of one-token requests over long prefixes spends far more of
    its forward in attention than one request's tree of as many tokens, though both are just
    query tokens to the knots. Without the row term the knots learned the batch's attention as
    the cost of any forward of that many tokens, so wider verifies looked free.

    The knots are kept per batch size (the forward's requests in their power-of-two class,
    :func:`batch_bucket`): each batch size's knots start as the measured ones and learn from that
    batch size's forwards only. One request's tree of 16 tokens and 16 requests of one token each
    are both 16 query tokens, but not the same forward: learned into one set of knots, a batch of
    one that speculates every step taught the knots that its 16-token verify costs what its plain
    step costs, and at batch 8 a verify of 8 roots and 8 drafts then looked as cheap as a plain step.
    ``ys`` are one request's knots.
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
        self._start = [float(ms) for _, ms in items]  # every batch size's starting knots
        self._ys: dict[int, list[float]] = {1: list(self._start)}
        if not attn_ms >= 0 or not row_ms >= 0 or kv_ref < 0:
            raise ValueError(f"CostModel: attn_ms ({attn_ms}), row_ms ({row_ms}) and kv_ref ({kv_ref}) must be >= 0")
        self.lr = lr
        self.attn_ms, self.row_ms, self.kv_ref = float(attn_ms), float(row_ms), int(kv_ref)
        self._unseen = False  # set by :meth:`online`: the first observation sets every knot
        self._anchored = True  # the start-up knots are a measured shape the knots drift back to

    @classmethod
    def online(cls, sizes: Sequence[int], lr: float = 0.2) -> "CostModel":
        """A model learned from the engine's own forwards, for engines that cannot time dummy
        forwards up front: the first observed forward sets every knot (a flat cost: an optimistic
        start for wide verifies, which the next observations correct), then :meth:`observe` refines
        the knots near each observed size."""
        model = cls({int(n): 1.0 for n in sizes}, lr)
        model._unseen, model._anchored = True, False
        return model

    @classmethod
    def measure(
        cls, forward: Callable[[int], object], sizes: Sequence[int], repeats: int = 5, lr: float = 0.2,
        kv_forward: Callable[[int, int, int], object] | None = None, kv_ref: int = 0, kv_long: int = 0,
        rows: int = 8, large_repeats: int | None = None,
    ) -> "CostModel":
        """Time ``forward(n)`` (which must block until the forward is done) at each size, against
        ``kv_ref`` cached tokens. With ``kv_forward(r, n, kv)`` (a forward of ``r`` requests x
        ``n`` query tokens against ``kv`` cached tokens each) also fit the attention terms: one
        request x the largest size below 64 and ``rows`` requests x 1 token, each against
        ``kv_ref`` and ``kv_long`` cached tokens; the first difference is ``row_ms + n * attn_ms``
        per extra cached token, the second ``rows * (row_ms + attn_ms)``.

        Each size keeps its fastest of ``repeats`` timings, taken in interleaved rounds over all
        sizes: noise only ever adds time, and a slow spell of a shared machine then has to hit one
        size in every round to distort it (timed back to back, one slow spell can price small
        verifies far above a plain step and keep the controller from speculating for a whole run).
        The sizes up to :data:`DENSE` (one request's verifies) take their rounds on their own,
        back to back as a verify's steps run, not each after a forward of hundreds of tokens;
        the larger sizes and the attention probes take ``large_repeats`` rounds (default
        ``repeats``): their forwards cost many small ones, and noise is a smaller share of each."""
        small = [int(n) for n in sizes if n <= DENSE]
        large = [int(n) for n in sizes if n > DENSE]
        timed: list[Callable[[], object]] = [lambda n=n: forward(n) for n in large]
        n_long = max((int(m) for m in sizes if m < 64), default=min(int(m) for m in sizes))
        probe = kv_forward is not None and kv_long > kv_ref and n_long > 1 and rows > 1
        if probe:
            assert kv_forward is not None
            timed += [lambda r=r, n=n, kv=kv: kv_forward(r, n, kv)
                      for r, n in ((1, n_long), (rows, 1)) for kv in (kv_ref, kv_long)]
        best = _fastest_ms([lambda n=n: forward(n) for n in small], repeats)
        best += _fastest_ms(timed, repeats if large_repeats is None else large_repeats) if timed else []
        points = dict(zip(small + large, best[: len(sizes)]))
        attn = row = 0.0
        if probe:
            span = kv_long - kv_ref
            per_token = max(best[-3] - best[-4], 0.0) / span  # row_ms + n_long * attn_ms
            per_row = max(best[-1] - best[-2], 0.0) / (rows * span)  # row_ms + attn_ms
            attn = max(per_token - per_row, 0.0) / (n_long - 1)
            row = max(per_row - attn, 0.0)
        return cls(points, lr, attn, kv_ref, row)

    def copy(self) -> "CostModel":
        """An independent copy (every batch size's knots, the attention terms, the learning rate)."""
        model = CostModel(list(zip(self.xs, self._start)), self.lr, self.attn_ms, self.kv_ref, self.row_ms)
        model._ys = {b: list(ys) for b, ys in self._ys.items()}
        model._unseen, model._anchored = self._unseen, self._anchored
        return model

    @property
    def ys(self) -> list[float]:
        """One request's knots (ms at each of :attr:`xs`)."""
        return self._ys[1]

    def knots(self, rows: int = 1) -> list[float]:
        """The knots of forwards of ``rows`` requests (a power-of-two batch size's; the measured
        knots until that batch size's first forward is observed)."""
        return self._ys.get(batch_bucket(rows), self._start)

    def _segment(self, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Left knot index and the weight of the right knot for each of ``n`` (clamped below the
        first knot; above the last the last segment extends: weight > 1)."""
        xs = np.asarray(self.xs, dtype=np.float64)
        if len(xs) == 1:
            return np.zeros(n.shape, dtype=np.int64), np.zeros(n.shape)
        i = np.clip(np.searchsorted(xs, n, side="right") - 1, 0, len(xs) - 2)
        return i, np.where(n <= xs[0], 0.0, (n - xs[i]) / (xs[i + 1] - xs[i]))

    @overload
    def __call__(self, n_tokens: float, kv: int | None = None, rows: int = 1) -> float: ...

    @overload
    def __call__(self, n_tokens: np.ndarray, kv: int | None = None, rows: int = 1) -> np.ndarray: ...

    def __call__(self, n_tokens: float | np.ndarray, kv: int | None = None, rows: int = 1) -> float | np.ndarray:
        """Predicted ms of a forward of ``n_tokens`` query tokens (a number, or an array of them:
        one prediction each) from ``rows`` requests, each against ``kv`` cached tokens (``None``:
        ``kv_ref``, the knots' own)."""
        if not isinstance(n_tokens, np.ndarray):
            return self._scalar(float(n_tokens), kv, rows)
        n = np.asarray(n_tokens, dtype=np.float64)
        ys = np.asarray(self.knots(rows), dtype=np.float64)
        if len(self.xs) == 1:
            base = ys[0] * np.maximum(n, self.xs[0]) / self.xs[0]
        else:
            i, w = self._segment(n)
            base = ys[i] + w * (ys[i + 1] - ys[i])  # w > 1 extends the last segment
        if kv is not None and (self.attn_ms or self.row_ms):
            # the attention terms: ms beyond (or, with fewer cached tokens, short of) the knots'
            base = base + np.maximum((kv - self.kv_ref) * (self.attn_ms * n + self.row_ms * rows), -0.5 * base)
        return base

    def _segment_of(self, n: float) -> tuple[int, float]:
        """:meth:`_segment` of one size, in plain Python."""
        xs = self.xs
        if len(xs) == 1:
            return 0, 0.0
        i = min(max(bisect.bisect_right(xs, n) - 1, 0), len(xs) - 2)
        return i, 0.0 if n <= xs[0] else (n - xs[i]) / (xs[i + 1] - xs[i])

    def _scalar(self, n: float, kv: int | None, rows: int) -> float:
        """:meth:`__call__` for one size, in plain Python (engines call it every step; the same
        arithmetic as the array path)."""
        ys = self.knots(rows)
        if len(self.xs) == 1:
            base = ys[0] * max(n, self.xs[0]) / self.xs[0]
        else:
            i, w = self._segment_of(n)
            base = ys[i] + w * (ys[i + 1] - ys[i])
        return self._with_attention(base, n, kv, rows)

    def _with_attention(self, base: float, n: float, kv: int | None, rows: int) -> float:
        """``base`` ms of a forward of ``n`` query tokens with the attention terms added."""
        if kv is not None and (self.attn_ms or self.row_ms):
            return base + max((kv - self.kv_ref) * (self.attn_ms * n + self.row_ms * rows), -0.5 * base)
        return base

    def least(self, lo: int, hi: int, kv: int | None = None, rows: int = 1) -> float:
        """The least predicted ms over forwards of ``lo..hi`` query tokens (``rows`` requests,
        ``kv`` as in :meth:`__call__`): the cost is piecewise linear in tokens, so it is at one of
        the ends or at a knot between them."""
        between = [self._with_attention(y, x, kv, rows) for x, y in zip(self.xs, self.knots(rows)) if lo < x < hi]
        return min([self._scalar(float(lo), kv, rows), self._scalar(float(hi), kv, rows)] + between)

    def observe(self, n_tokens: int, ms: float, kv: int | None = None, rows: int = 1) -> None:
        """Move the knots toward one measured forward (``ms`` for ``n_tokens`` query tokens of
        ``rows`` requests against ``kv`` cached tokens each; the attention terms are taken as
        measured).

        Two moves: every knot is scaled by ``lr / 2`` of the relative error (the level), then the
        knots around ``n_tokens`` take ``lr`` of what is left (the shape). The level carries what a
        forward at one size says about every size: timed back to back at start-up, forwards run
        with the weights warm in the caches, while an engine's steps interleave drafting and
        sampling; a batch that always speculates never re-times the plain forward it is compared
        with, and local moves alone would leave that knot at its start-up value. Third, the knots
        outside the observed segment drift back (at ``lr / 20``) toward the start-up shape at the
        level observed there: the level alone would walk them with the observed size's noise."""
        if n_tokens < 1 or not ms > 0:
            raise ValueError(f"observe({n_tokens}, {ms}): n_tokens must be >= 1 and ms > 0")
        if self._unseen:
            self._start, self._unseen = [float(ms)] * len(self.xs), False
            self._ys = {1: list(self._start)}
            return
        bucket = batch_bucket(rows)
        ys = self._ys.get(bucket)
        if ys is None:
            ys = self._ys[bucket] = list(self._start)
        n = float(n_tokens)
        if len(self.xs) == 1:
            predicted = self._scalar(n, kv, rows)
            ratio = min(max(ms / max(predicted, 1e-6), _CLIP_LOW), _CLIP_HIGH)
            level = 1 + self.lr / 2 * (ratio - 1)
            y0 = ys[0] * level
            y0 += self.lr * (ratio * predicted - self._with_attention(y0 * max(n, self.xs[0]) / self.xs[0], n, kv, rows)) \
                * self.xs[0] / max(n_tokens, self.xs[0])
            ys[0] = max(y0, 1e-6)
            return
        # one pass over the knots (engines call this every step): the prediction and its segment
        # are read once, the level's scaling, the drift back and the floor are one list
        i, w = self._segment_of(n)
        predicted = self._with_attention(ys[i] + w * (ys[i + 1] - ys[i]), n, kv, rows)
        # one odd step moves it little: a measurement counts as at most 1.25x (at least 0.8x) the
        # prediction, so a spike of the machine at a size that is rarely timed again (the verify
        # shape that then looks too dear to plan) is not learned as that size's cost
        ratio = min(max(ms / max(predicted, 1e-6), _CLIP_LOW), _CLIP_HIGH)
        level = 1 + self.lr / 2 * (ratio - 1)
        lo, hi = ys[i] * level, ys[i + 1] * level
        err = ratio * predicted - self._with_attention(lo + w * (hi - lo), n, kv, rows)
        w = min(w, 1.0)
        lo += self.lr * (1 - w) * err
        hi += self.lr * w * err
        start = self._start
        if not self._anchored:
            ys[:] = [max(y * level, 1e-6) for y in ys]
            ys[i], ys[i + 1] = max(lo, 1e-6), max(hi, 1e-6)
            return
        # the shape's anchor: every other knot drifts back (at lr / 20) toward the start-up shape
        # at the level just observed. Knots that are not timed again only ever moved with the
        # level, which the observed knot's noise walks up and down; they now follow it back. The
        # observed segment keeps the share of the shape move each of its knots took.
        at_start = start[i] + w * (start[i + 1] - start[i])
        scale = (lo + w * (hi - lo)) / max(at_start, 1e-6)
        pull = self.lr / 20
        ys[:] = [max(y + pull * (scale * s0 - y), 1e-6) for y, s0 in zip([y * level for y in ys], start)]
        ys[i] = max(lo + pull * (1 - (1 - w)) * (scale * start[i] - lo), 1e-6)
        ys[i + 1] = max(hi + pull * (1 - w) * (scale * start[i + 1] - hi), 1e-6)


_CLIP_LOW, _CLIP_HIGH = 0.8, 1.25  # CostModel.observe: how far one measurement may pull


#: the sizes of one request's verifies: every one is a knot (:func:`knot_sizes`), timed on its own
#: rounds at start-up (:meth:`CostModel.measure`)
DENSE = 16


def knot_sizes(limit: int) -> list[int]:
    """Sizes to time a forward at, up to ``limit`` query tokens: every size up to :data:`DENSE`
    (the verifies of one request's trees, whose cost need not grow with their tokens there), then
    powers of two."""
    return [n for n in range(1, DENSE + 1) if n <= limit] + [1 << i for i in range(DENSE.bit_length(), 31)
                                                              if (1 << i) <= limit and (1 << i) > DENSE]


def batch_bucket(rows: int) -> int:
    """A forward's batch size rounded to the nearest power of two on a log scale (the knots' and
    the controller's per-batch-size key): 3 -> 4, 5 -> 4, 6 -> 8, 11 -> 8, 12 -> 16. A batch that
    shrinks from a power of two (8 requests of which one finished) stays in its class until it is
    nearer the one below, where its forwards cost about the same."""
    rows = max(int(rows), 1)
    low = 1 << (rows.bit_length() - 1)
    return 2 * low if rows * rows > 2 * low * low else low


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
    quantized self-draft, pays per depth for every drafting request). Exponentially forgetting least squares,
    regularised toward the prior coefficients (the ``draft_ms_*`` options), so it starts from them
    and follows the measured drafter (including tree building) as steps are observed;
    coefficients are kept non-negative. The fixed cost ``a`` is held to its prior far more loosely
    (:data:`_FIXED_RIDGE` of the others' weight): where the steps' depths and nodes vary little
    (an n-gram drafter's chains of 2-3 nodes at batch 1, every term moving together), an even
    pull on all four terms explained a fixed cost per step as cost per node and level, and priced
    deeper chains well above what they cost (a replay of ~1 ms steps: a chain of 8 at 2.3 ms).
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
        self._support: tuple[int, ...] | None = None  # the last fit's non-zero coefficients: the next fit's guess

    @overload
    def __call__(self, depth: int, nodes: int, rows: int = 1) -> float: ...

    @overload
    def __call__(self, depth: np.ndarray, nodes: np.ndarray, rows: np.ndarray) -> np.ndarray: ...

    def __call__(self, depth: int | np.ndarray, nodes: int | np.ndarray,
                 rows: int | np.ndarray = 1) -> float | np.ndarray:
        """Predicted ms (0 without nodes); numbers, or arrays of as many steps."""
        a, b, c, e = self.coef
        if not isinstance(nodes, np.ndarray):  # one step (the planner's bound asks every plan): plain Python
            return a + b * depth + c * nodes + e * depth * rows if nodes > 0 else 0.0
        depth = np.asarray(depth)
        return np.where(nodes > 0, a + b * depth + c * nodes + e * depth * np.asarray(rows), 0.0)

    def observe(self, depth: int, nodes: int, ms: float, rows: int = 1) -> None:
        """One measured drafting step (``nodes`` > 0, ``rows`` >= 1 requests drafting)."""
        if nodes <= 0 or depth <= 0 or rows <= 0 or not ms >= 0:
            raise ValueError(f"DraftCost.observe({depth}, {nodes}, {ms}, {rows}): depth, nodes, rows > 0 and "
                             "ms >= 0 needed")
        x, f, w = (1.0, float(depth), float(nodes), float(depth * rows)), self.forget, self.prior_weight
        self._xx = [[f * v + xi * xj for v, xj in zip(row, x)] for row, xi in zip(self._xx, x)]
        self._xy = [f * v + xi * ms for v, xi in zip(self._xy, x)]
        ws = (w * _FIXED_RIDGE, w, w, w)
        ridged = [[v + (ws[i] if i == j else 0.0) for j, v in enumerate(row)] for i, row in enumerate(self._xx)]
        self.coef, self._support = _nonnegative_solve(ridged, [v + wi * p for v, wi, p in zip(self._xy, ws, self.prior)],
                                                      self._support)


#: DraftCost: the fixed cost's pull toward its prior, relative to the other terms'
_FIXED_RIDGE = 0.01


class DraftCosts:
    """Drafting cost learned per class of drafting requests (:func:`batch_bucket` of the rows
    that draft): one :class:`DraftCost` each, called and fed as one.

    A drafter's step does not grow linearly with the requests it drafts for (Hydra's heads read
    the same weights for one row as for sixteen), and in one least-squares fit over every batch
    size a step of many rows weighs like dozens of one-row steps (its ``depth x rows`` term is
    large): wide steps (in one vLLM engine, one warm-up step of four requests) then set the price
    of each one-row level, and the one-node chains that price chose at batch 1, all of one shape,
    could not correct it. A class that has not drafted yet is priced by the nearest class that
    has (on a log scale; the prior, the ``draft_ms_*`` options, before any has) and starts its
    own fit from that class's coefficients.
    """

    def __init__(self, prior: Sequence[float]) -> None:
        self._prior = DraftCost(prior)  # validates the prior; never observes
        self._models: dict[int, DraftCost] = {}

    def model(self, rows: int = 1) -> DraftCost:
        """The model that prices steps of ``rows`` drafting requests: their class's, else the
        nearest learned class's, else the prior."""
        cls = batch_bucket(rows)
        if cls in self._models or not self._models:
            return self._models.get(cls, self._prior)
        return self._models[min(self._models, key=lambda k: (abs(math.log2(k / cls)), k))]

    @overload
    def __call__(self, depth: int, nodes: int, rows: int = 1) -> float: ...

    @overload
    def __call__(self, depth: np.ndarray, nodes: np.ndarray, rows: np.ndarray) -> np.ndarray: ...

    def __call__(self, depth: int | np.ndarray, nodes: int | np.ndarray,
                 rows: int | np.ndarray = 1) -> float | np.ndarray:
        """Predicted ms (0 without nodes), each step by :meth:`model` of its rows; numbers, or
        arrays of as many steps."""
        if not isinstance(nodes, np.ndarray):
            return self.model(int(rows))(int(depth), int(nodes), int(rows))  # type: ignore[arg-type]
        depth, rows = np.broadcast_to(depth, nodes.shape), np.broadcast_to(rows, nodes.shape)
        models = {count: self.model(count) for count in set(rows.ravel().tolist())}  # a batch's few counts
        if len({id(m) for m in models.values()}) == 1:  # one class: every step by its model at once
            return next(iter(models.values()))(depth, nodes, rows)
        ms = np.zeros(nodes.shape)
        for count, model in models.items():
            at = rows == count
            ms[at] = model(depth[at], nodes[at], rows[at])
        return ms

    def observe(self, depth: int, nodes: int, ms: float, rows: int = 1) -> None:
        """One measured drafting step, learned by its class's model (:meth:`DraftCost.observe`)."""
        cls = batch_bucket(rows)
        if cls not in self._models:
            self._models[cls] = DraftCost(self.model(cls).coef, self._prior.forget, self._prior.prior_weight)
        self._models[cls].observe(depth, nodes, ms, rows)


def _nonnegative_solve(a: list[list[float]], b: list[float],
                       support: tuple[int, ...] | None = None) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """The non-negative ``x`` that minimises ``x.a.x - 2 b.x`` (a least-squares fit's normal
    equations ``a x = b``, ``a`` positive definite), and its support (the coefficients not held at
    0): the unconstrained solution when it is non-negative, else the best over the subsets of
    coefficients held at 0 (each subset's optimum is ``-b.x`` there). Clipping the unconstrained
    solution instead is wrong where terms move together (a chain's nodes are its depth, and at one
    row so is ``depth x rows``): one term's large positive coefficient, offset by its twins'
    negative ones, was kept alone, and after one 11-node tree a chain of 4 was priced at 15 ms
    where its steps took ~3. ``support``: a guess (the previous fit's); the problem is strictly
    convex, so its one optimum is the guess's solution when that is non-negative and no
    coefficient held at 0 would lower the objective (``(a x - b)_i >= 0`` there): then one solve
    replaces the search over subsets."""
    n = len(b)
    x = _solve(a, b)
    if min(x) >= 0:
        return tuple(x), tuple(range(n))
    if support is not None and len(support) < n:
        guess = _on_support(a, b, support)
        # the objective's slope along each coefficient held at 0 (rounding's share allowed)
        if guess is not None and all(sum(a[i][j] * guess[j] for j in support) - b[i] >= -1e-9 * abs(b[i])
                                     for i in range(n) if i not in support):
            return guess, support
    best, best_value, best_free = (0.0,) * n, 0.0, ()  # every coefficient at 0
    for free in itertools.chain.from_iterable(itertools.combinations(range(n), k) for k in range(n - 1, 0, -1)):
        full = _on_support(a, b, free)
        if full is None:
            continue
        value = -sum(b[i] * full[i] for i in free)
        if value < best_value:
            best, best_value, best_free = full, value, free
    return best, best_free


def _on_support(a: list[list[float]], b: list[float], free: tuple[int, ...]) -> tuple[float, ...] | None:
    """The optimum with every coefficient outside ``free`` held at 0, or ``None`` where it is
    negative somewhere (not feasible)."""
    if not free:
        return (0.0,) * len(b)
    sub = _solve([[a[i][j] for j in free] for i in free], [b[i] for i in free])
    if min(sub) < 0:
        return None
    full = [0.0] * len(b)
    for i, v in zip(free, sub):
        full[i] = v
    return tuple(full)


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
