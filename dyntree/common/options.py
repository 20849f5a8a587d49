"""Options for the dynamic tree builder and the adaptive speculation controller, and the tree
budget both are given.

The options are pydantic v2 models with ``extra="forbid"``: an unknown or invalid field raises a
``pydantic.ValidationError`` whose message names the field. The defaults work out of the box for
a small draft source (n-gram, draft heads, self-draft) against a target whose verify forward of a
few dozen tokens costs about one decode step. The tree budget (:class:`Budget`) and shape are not
options of either: :class:`~dyntree.common.config.SpecConfig` owns them and hands them over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["Budget", "TreeOptions", "CalibrationOptions", "ControllerOptions", "TreeMode", "SamplingScheme"]

TreeMode = Literal["chain", "static", "dyntree", "beam"]
SamplingScheme = Literal["without_replacement", "iid"]


@dataclass(frozen=True)
class Budget:
    """The largest tree one request may draft: ``max_nodes`` draft nodes (the root not counted)
    and depth ``max_depth`` (``SpecConfig.budget``; the controller plans within it)."""

    max_nodes: int
    max_depth: int

    def __post_init__(self) -> None:
        if self.max_nodes < 0 or self.max_depth < 0:
            raise ValueError(f"{self}: max_nodes and max_depth must be >= 0")


class CalibrationOptions(BaseModel):
    """Online calibration of draft confidence to measured acceptance (see ``calibration.py``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    confidence_bins: int = Field(10, ge=1, le=100, description="equal-width bins over draft confidence [0, 1]")
    entropy_edges: tuple[float, ...] = Field(
        (0.5, 1.5, 3.0), description="increasing entropy (nats) bin edges; len+1 entropy bins"
    )
    rank_bins: int = Field(
        4, ge=1, le=64, description="candidate ranks (0 = the drafter's first) with bins of their own; lower "
        "ranks share the last (a near-exact self-draft's first choice and a runner-up of equal confidence are "
        "not equally likely to be accepted)"
    )
    max_depth: int = Field(16, ge=1, le=256, description="depths beyond this share the last depth's table")
    prior_strength: float = Field(
        8.0, gt=0, description="pseudo-observations of the identity map per bin (higher = slower to move)"
    )
    decay: float = Field(
        0.999, gt=0, le=1, description="per-observation decay of old evidence (1 = never forget)"
    )
    refresh: int = Field(
        32, ge=1, description="observations folded in before the predictions are recomputed (1: after every "
        "update; 32 observations move the evidence by ~3%)"
    )

    @model_validator(mode="after")
    def _edges_increasing(self) -> "CalibrationOptions":
        e = self.entropy_edges
        if any(b <= a for a, b in zip(e, e[1:])) or any(x < 0 for x in e):
            raise ValueError(f"entropy_edges must be non-negative and strictly increasing, got {e}")
        return self


class TreeOptions(BaseModel):
    """How the builder shapes a draft tree.

    The dynamic (``dyntree``) mode grows the tree depth by depth: a frontier node of draft entropy
    ``H`` may get up to ``k(H)`` children, ``k = 1`` for ``H <= entropy_low``, ``max_children`` for
    ``H >= entropy_high``, linear in between; a child is kept only if its path value (the product
    of calibrated acceptance probabilities along its path) is at least ``threshold``; the tree is
    bounded by each tree's budget (the builder is given it, and the shape, per call).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    threshold: float = Field(0.02, ge=0, le=1, description="stop a branch whose path value is below this")
    max_children: int = Field(
        4, ge=1, le=64,
        description="most children of one node in dyntree mode under the entropy rule (a drafter with an "
        "acceptance table or candidates_per_node offers its candidates and the values choose)",
    )
    entropy_low: float = Field(0.3, ge=0, description="at or below this draft entropy (nats): one child")
    entropy_high: float = Field(2.0, ge=0, description="at or above this draft entropy (nats): max_children")
    max_frontier: int = Field(
        32, ge=1, le=1024, description="most nodes expanded per depth (bounds the drafter's batch)"
    )
    static_shape: tuple[tuple[int, ...], ...] | None = Field(
        None,
        description="static mode: rank paths like ((0,), (0, 0), (1,)), each path's prefix listed "
        "before it; default: Medusa's 63-node mc_sim_7b_63",
    )
    sampling_support: int = Field(
        32, ge=1, le=4096, description="sampling: children are drawn from the draft's top this-many tokens (renormalised)"
    )
    sampling_scheme: SamplingScheme = Field(
        "without_replacement",
        description="how sampled children of one node are drawn (the verifier must assume the same)",
    )
    calibration: CalibrationOptions = CalibrationOptions()

    @model_validator(mode="after")
    def _check(self) -> "TreeOptions":
        if self.entropy_high < self.entropy_low:
            raise ValueError(
                f"entropy_high ({self.entropy_high}) must be >= entropy_low ({self.entropy_low})"
            )
        if self.static_shape is not None:
            seen: set[tuple[int, ...]] = {()}
            for path in self.static_shape:
                if not path or any(r < 0 for r in path):
                    raise ValueError(f"static_shape path {path} must be non-empty non-negative ranks")
                if path[:-1] not in seen:
                    raise ValueError(f"static_shape path {path} comes before its prefix {path[:-1]}")
                if path in seen:
                    raise ValueError(f"static_shape path {path} is repeated")
                seen.add(path)
        return self


class ControllerOptions(BaseModel):
    """How the adaptive controller sizes speculation per request and per batch (within the
    :class:`Budget` it is given)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch_tokens: int = Field(
        4096, ge=1, description="most query tokens (roots + drafts) in one verify forward"
    )
    allow_trees: bool = Field(True, description="False: only chains (or nothing)")
    ema: float = Field(
        0.1, gt=0, le=1, description="weight of the newest step in the acceptance EMA (a larger weight lets a "
        "few misses stop a request's speculation)"
    )
    alpha_prior: float = Field(
        0.5, ge=0, le=1, description="top-1 draft acceptance assumed before any is observed (then new "
        "requests start from the acceptance observed over all requests)"
    )
    prior_weight: float = Field(
        2.0, gt=0,
        description="how much a prior weighs: a request's acceptance starts at its population's as if observed "
        "this many times (its idle steps fade its own observations back to that weight) and a deeper tree level's "
        "at the level above's; the population statistics start at theirs with this many times an EMA's full weight",
    )
    relax: float = Field(
        0.02,
        ge=0,
        le=1,
        description="per step without speculation, a request's acceptance estimate moves this far "
        "back toward the better of alpha_prior and the acceptance observed over all requests (so a "
        "request that stopped speculating probes again now and then)",
    )
    sibling_gain_prior: float = Field(
        0.3,
        ge=0,
        le=1,
        description="what an extra sibling is worth relative to an independent first draft "
        "(0: nothing, 1: as much); refined online",
    )
    min_node_value: float = Field(
        0.01, ge=0, le=1, description="skip draft nodes expected to add fewer accepted tokens than this (the plan "
        "weighs every other node against what it costs: where a verify of a few more tokens costs no more, as "
        "vLLM's CPU forward at batch 1, nodes worth a few hundredths of a token still pay)"
    )
    objective: Literal["auto", "throughput", "batch"] = Field(
        "auto",
        description="what a plan maximises: 'throughput', the batch's committed tokens per ms (right while "
        "requests wait: a request that finishes early frees its place for one of them); 'batch', the pace of "
        "the request that will finish last (right when nothing waits: the batch lasts as long as that request, "
        "so drafts for the others only add to every step); 'auto', 'batch' when the engine reports that no "
        "request waits, else 'throughput'",
    )
    quiet_steps: int = Field(
        8, ge=0, le=64,
        description="after a plan that found nothing paying though the drafter could draft for every request "
        "(or, by a bound, could not pay if it could), the same batch decodes this many steps at most without "
        "planning (1 after the first such plan, doubling while they keep coming; more where a plan is dear: "
        "quiet_share; 0: plan every step)",
    )
    quiet_share: float = Field(
        0.002, ge=0, lt=1,
        description="a quiet spell may also grow past quiet_steps (doubling, up to 64 steps) until the plan that "
        "ends it costs at most this share of the spell's plain decoding: in a big batch a plan that drafts nothing "
        "costs milliseconds (0: spells stop at quiet_steps)",
    )
    probe_steps: int = Field(
        64, ge=0,
        description="after this many steps at a batch size without speculation though the drafter could draft "
        "for every request, the next plan speculates its best plan even below the bar: a probe that times the "
        "verify, the drafting and the outcome again, so a controller that learned in a slow spell of the machine "
        "(or catch-up it has since paid) does not stay off for the rest of the run; the wait doubles after each "
        "probe that nothing paying follows, up to 1024 steps (0: never probe)",
    )
    probe_loss: float = Field(
        0.5, ge=0,
        description="a probe speculates the best plan predicted to cost at most this share of a plain step more "
        "than plain decoding takes for the tokens it commits (else the plan predicted to lose least), "
        "so a probe at a batch size where speculation does not pay stays cheap",
    )
    min_gain: float = Field(
        1.03,
        ge=1,
        description="speculate only if predicted throughput beats plain decoding by this factor",
    )
    draft_ms_fixed: float = Field(0.0, ge=0, description="prior drafter cost per step when any request drafts (refined online)")
    draft_ms_per_depth: float = Field(0.0, ge=0, description="prior drafter cost per tree depth level (refined online)")
    draft_ms_per_node: float = Field(0.0, ge=0, description="prior drafter cost per draft node in the batch (refined online)")
    draft_ms_per_depth_row: float = Field(
        0.0, ge=0, description="prior drafter cost per tree depth level and drafting request (refined online)"
    )
    catch_up_steps: int = Field(
        16, ge=1,
        description="a drafter's catch-up (Hydra's prefix layer over a request's positions, at its first draft or "
        "after idle steps) is paid once and serves every later step that drafts: a plan prices it spread over the "
        "steps it serves, the request's remaining tokens over 2 (a speculating step commits about two), at most "
        "this many over the batch size (a batch pays its catch-ups together and speculates on fewer of its later "
        "steps), times the share of that batch size's recent plans that drafted (where plans seldom draft, a "
        "catch-up serves about one step; 1: all of it at the step that pays it, which keeps a request that starts "
        "or resumes from ever drafting where one step's gain cannot cover it)",
    )
    cost_lr: float = Field(0.2, ge=0, le=1, description="online learning rate of the cost model")
    outcome_ema: float = Field(
        0.05,
        ge=0,
        le=1,
        description="weight of the newest step in the planner's outcome checks: the tokens speculative steps, "
        "and apart from them plain steps, committed over the tokens their plans predicted for the measured "
        "ms (EMAs of both; one step's prediction clipped to [0.25, 4] x its tokens); speculation must beat "
        "plain decoding by min_gain after the corrections (0: trust the predictions as they are)",
    )
    outcome_relax: float = Field(
        1e-3,
        ge=0,
        le=1,
        description="per step without speculation, the outcome check's ratio moves this far back toward 1 "
        "(so speculation is retried now and then)",
    )
    outcome_bound: float = Field(
        1.25,
        ge=1,
        description="the outcome checks scale predicted speculative rates down, and plain decoding's predicted "
        "rate up, by at most this factor (each alone and both together), never the other way (they veto "
        "marginal speculation; a plan predicted to pay 1.25 x min_gain is not overruled)",
    )
