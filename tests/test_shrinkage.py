"""Dispersion: the prior strength of an evidence class, from its finished requests' acceptance."""

from __future__ import annotations

import numpy as np
import pytest

from dyntree.common.shrinkage import Dispersion


def test_no_strength_before_two_requests_with_trials_nor_while_every_trial_hit() -> None:
    d = Dispersion(keep=1.0, high=40.0)
    assert d.strength() == 0.0 and d.rate == 0.0
    d.add(3, 20)
    d.add(0, 0)  # a request that never drafted in the class: nothing to learn
    assert d.n == 1.0 and d.strength() == 0.0
    full = Dispersion(keep=1.0, high=40.0)
    for _ in range(5):
        full.add(10, 10)
    assert full.strength() == 0.0  # p = 1: no scatter to measure
    with pytest.raises(ValueError, match="hits <= trials"):
        d.add(5, 4)


def test_requests_alike_weigh_the_class_fully_and_unlike_ones_hardly() -> None:
    # 20 trials each: every request at 4 hits (no scatter beyond chance: the cap), or alternately
    # 1 and 12 hits (far more than chance): a small strength, near the beta-binomial moment match
    alike, unlike = Dispersion(1.0, 40.0), Dispersion(1.0, 40.0)
    for i in range(8):
        alike.add(4, 20)
        unlike.add(1 if i % 2 else 12, 20)
    assert alike.strength() == 40.0 and alike.rate == pytest.approx(0.2)
    p = unlike.rate
    rates = np.array([12 / 20, 1 / 20] * 4)
    between = rates.var(ddof=1) - p * (1 - p) / 20  # the rates' variance beyond binomial scatter
    moment = p * (1 - p) / between - 1  # beta-binomial: var = p (1 - p) / (m + 1)
    assert 0 < unlike.strength() < 5
    assert unlike.strength() == pytest.approx(moment, rel=0.25)


def test_binomial_requests_read_a_large_strength_on_average() -> None:
    # requests whose hits are binomial at one rate: the estimate's median sits at or near the cap,
    # while requests drawn at rates 0.02 and 0.6 (a beta-binomial strength of ~1.5) read a small one
    rng = np.random.default_rng(0)
    same, mixed = [], []
    for _ in range(200):
        a, b = Dispersion(1.0, 40.0), Dispersion(1.0, 40.0)
        for i in range(12):
            a.add(int(rng.binomial(20, 0.2)), 20)
            b.add(int(rng.binomial(20, 0.02 if i % 2 else 0.6)), 20)
        same.append(a.strength())
        mixed.append(b.strength())
    assert np.median(same) >= 20 and np.median(mixed) < 3


def test_older_requests_fade() -> None:
    # after a run of alike requests, unlike ones take over as the old ones fade
    d = Dispersion(keep=0.8, high=40.0)
    for _ in range(20):
        d.add(4, 20)
    assert d.strength() == 40.0
    for i in range(30):
        d.add(0 if i % 2 else 16, 20)
    assert d.strength() < 2 and d.n == pytest.approx(sum(0.8**k for k in range(50)))
