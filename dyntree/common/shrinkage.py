"""How far one request's acceptance in an evidence class may stray from the class's.

A request's own acceptance estimate rests on a few observations (an EMA of ~10 steps, fewer in a
rare evidence class), so it scatters widely around what the request really accepts; the class's
acceptance over every request is steady but blind to a request that is easier or harder than
the rest. :class:`Dispersion` measures, per evidence class, how much finished requests' acceptance
really varied beyond that binomial scatter (the beta-binomial method of moments over their
undecayed hits and trials) and turns it into the weight, in observations, that their pooled
acceptance deserves beside a request's own: large where requests hardly differ (the n-gram's
one-token matches, whose per-request EMA otherwise swings between drafting and declining), small
where they do. Pure bookkeeping on floats: the controller decides what to read it for.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Dispersion:
    """One evidence class's finished requests, as decayed sums (each :meth:`add` fades the earlier
    requests by ``keep``): count, trials, hits, trials squared and hits squared over trials.
    :meth:`strength` reads the prior strength within ``[0, high]`` observations."""

    keep: float
    high: float
    n: float = 0.0
    trials: float = 0.0
    hits: float = 0.0
    trials_sq: float = 0.0
    hits_sq_over_trials: float = 0.0
    _strength: float | None = field(default=None, init=False, repr=False)  # strength(), until the next add

    def add(self, hits: int, trials: int) -> None:
        """A finished request's first-draft ``hits`` of ``trials`` in this class (none: ignored)."""
        if trials <= 0:
            return
        if not 0 <= hits <= trials:
            raise ValueError(f"Dispersion.add({hits}, {trials}): 0 <= hits <= trials needed")
        k = self.keep
        self.n = k * self.n + 1.0
        self.trials = k * self.trials + trials
        self.hits = k * self.hits + hits
        self.trials_sq = k * self.trials_sq + trials * trials
        self.hits_sq_over_trials = k * self.hits_sq_over_trials + hits * hits / trials
        self._strength = None

    @property
    def rate(self) -> float:
        """The pooled acceptance of the finished requests (hits over trials; 0 before any)."""
        return self.hits / self.trials if self.trials > 0 else 0.0

    def strength(self) -> float:
        """Observations the class's acceptance weighs beside a request's own: ``1 / rho - 1`` for
        the requests' intra-class correlation ``rho`` (beta-binomial: a request's hits in ``t``
        trials vary ``t p (1 - p) (1 + (t - 1) rho)``), moment-matched on the chi-square of the
        requests' hits around the pooled rate; ``low`` before two requests with trials, or while
        every trial hit or missed."""
        if self._strength is None:
            self._strength = self._estimate()
        return self._strength

    def _estimate(self) -> float:
        if self.n < 2.0 or self.trials <= 0:
            return 0.0
        p = self.hits / self.trials
        if not 0.0 < p < 1.0:
            return 0.0
        chi2 = (self.hits_sq_over_trials - p * self.hits) / (p * (1.0 - p))
        # E[chi2] = n - 1 + rho (trials - n - (trials_sq / trials - 1)) to first order
        room = self.trials - self.n - (self.trials_sq / self.trials - 1.0)
        if room <= 0:
            return 0.0
        rho = (chi2 - (self.n - 1.0)) / room
        if rho <= 1.0 / (1.0 + self.high):
            return self.high
        return max(1.0 / rho - 1.0, 0.0)
