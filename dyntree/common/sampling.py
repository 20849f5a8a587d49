"""Lossless sampling on draft trees (temperature > 0).

Two pieces:

* :func:`process_logits` turns logits into the sampling distribution (temperature, top-k,
  top-p). The engine applies the *same* function to the target's and to the draft's logits, so
  both sides are shaped consistently.
* :func:`sample_verify` walks a draft tree against the target's distributions at every node and
  returns the accepted path plus one bonus/residual token. Whatever the draft proposes, the
  committed tokens are distributed exactly as plain sampling from the target would give.

Drafting schemes (the verifier must be told which one drew the tree's children):

* ``tree.draft_dists is None`` (deterministic drafters: n-gram, greedy top-k): every child is a
  *point-mass proposal*. At a node with target distribution ``p`` and children ``x_1..x_k`` (in
  order, repeats allowed): accept ``x_j`` with probability ``p_j(x_j)``; on rejection
  ``p_{j+1} = p_j`` with ``x_j`` removed and renormalised; if every child is rejected, draw the
  bonus token from the last ``p``. Lossless for *any* fixed children (chosen without looking at
  the target's random draws): ``p_j(x) = a_j [x = x_j] + (1 - a_j) p_{j+1}(x)`` at every step.
* ``scheme="without_replacement"`` (default; recursive rejection sampling, RSD): the children of
  node ``i`` were drawn one after another *without replacement* from ``q = draft_dists[i]``
  (``q_{j+1}`` = ``q_j`` with ``x_j`` removed, renormalised). Accept ``x_j`` with probability
  ``min(1, p_j(x_j) / q_j(x_j))``; on rejection ``p_{j+1} = norm(max(p_j - q_j, 0))``.
* ``scheme="iid"`` (SpecInfer multi-step speculative sampling): the children were drawn i.i.d.
  from ``q`` (siblings may repeat a token); same rule with ``q_j = q`` throughout.

Both stochastic schemes are standard speculative sampling applied step by step with a proposal
``q_j`` that depends only on earlier steps, so each step preserves ``p_j`` exactly. The number of
children of a node may depend on anything drawn *before* them (the node's own distribution, its
path, other branches), never on the children's own tokens: a builder must not drop sampled
children after looking at them (see ``builder.py``, which decides counts before drawing).
"""

from __future__ import annotations

from typing import get_args

import torch

from dyntree.common.options import SamplingScheme
from dyntree.common.tree import DraftTree
from dyntree.common.verify import VerifyResult, sampling_accept

__all__ = ["SamplingScheme", "process_logits", "node_outcomes", "node_accept_probs", "sample_verify"]

_SCHEMES = get_args(SamplingScheme)
_EPS = 1e-12


def process_logits(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Sampling distribution ``[..., V]`` (float32) from logits ``[..., V]``.

    ``temperature == 0`` gives a one-hot argmax (greedy as a point mass). ``top_k > 0`` keeps the
    ``top_k`` largest logits (ties with the k-th value are kept too); ``top_p < 1`` keeps the
    smallest set of most likely tokens whose mass reaches ``top_p`` (the most likely token always
    stays). Top-k is applied before top-p. Use the same call for the target and the draft.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError("process_logits: logits must be a tensor [..., V] with V > 0")
    if not temperature >= 0:
        raise ValueError(f"process_logits: temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"process_logits: top_k must be >= 0 (0 = off), got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"process_logits: top_p must be in (0, 1], got {top_p}")
    x = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).float()
    x = x / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1:
        probs = torch.softmax(x, dim=-1)
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def _normalise(v: torch.Tensor) -> torch.Tensor | None:
    """``v / v.sum()``, or ``None`` when ``v`` has (numerically) no mass."""
    s = float(v.sum())
    return v / s if s > _EPS else None


def _uniform(generator: torch.Generator | None) -> float:
    gen_device = generator.device if generator is not None else torch.device("cpu")
    return float(torch.rand((), generator=generator, device=gen_device, dtype=torch.float64))


def _categorical(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from an (unnormalised, non-negative) 1-D distribution by inverting its CDF."""
    cdf = probs.cumsum(0, dtype=torch.float64)
    u = torch.tensor([_uniform(generator) * float(cdf[-1])], dtype=cdf.dtype, device=cdf.device)
    # right=True returns the first index whose CDF exceeds u: never a zero-probability entry.
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.numel() - 1)


class _ChildWalk:
    """Sequential accept/reject state at one node: the current target ``p_j`` and proposal
    ``q_j``. Shared by the exact enumeration (:func:`node_outcomes`) and the sampler."""

    def __init__(self, p: torch.Tensor, q: torch.Tensor | None, scheme: SamplingScheme) -> None:
        if scheme not in _SCHEMES:
            raise ValueError(f"scheme must be one of {_SCHEMES}, got {scheme!r}")
        self.vocab = p.shape[-1]
        cur = _normalise(p.double())
        if cur is None:
            raise ValueError("target distribution p has no mass")
        self.cur = cur
        self.q: torch.Tensor | None = None
        if q is not None:
            if q.shape[-1] != self.vocab:
                raise ValueError(f"draft distribution has vocab {q.shape[-1]}, target has {self.vocab}")
            self.q = _normalise(q.double())
            if self.q is None:
                raise ValueError("draft distribution q has no mass")
        self.scheme = scheme
        self.index = 0

    def accept_prob(self, x: int) -> float:
        """Probability of accepting the next child, whose token is ``x``."""
        if not 0 <= x < self.vocab:
            raise ValueError(f"child token {x} is outside the vocabulary of size {self.vocab}")
        if self.q is None:
            return float(self.cur[x])
        qx = float(self.q[x])
        if qx <= 0:
            raise ValueError(
                f"child {self.index} (token {x}) has zero draft probability under scheme "
                f"{self.scheme!r}: it cannot have been drawn from draft_dists"
            )
        return min(1.0, float(self.cur[x]) / qx)

    def reject(self, x: int) -> None:
        """Move to the state after rejecting the child with token ``x``."""
        self.index += 1
        if self.q is None:
            nxt = self.cur.clone()
            nxt[x] = 0.0
        else:
            nxt = (self.cur - self.q).clamp_min(0)
            if self.scheme == "without_replacement":
                left = self.q.clone()
                left[x] = 0.0
                # An exhausted proposal can draw no further child; accept_prob would then raise.
                self.q = _normalise(left) if float(left.sum()) > _EPS else torch.zeros_like(left)
        # nxt has no mass only when rejection had probability ~0 (rounding); keep cur then.
        nxt_n = _normalise(nxt)
        if nxt_n is not None:
            self.cur = nxt_n


def node_outcomes(
    p: torch.Tensor,
    child_tokens: list[int],
    q: torch.Tensor | None,
    scheme: SamplingScheme = "without_replacement",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact outcome probabilities of verifying one node's children (what the sampler draws).

    Args:
        p: ``[V]`` target distribution after the node.
        child_tokens: the children's tokens in drafting order.
        q: ``[V]`` draft distribution the children were drawn from, or ``None`` for point-mass
            (deterministic) proposals.
        scheme: how stochastic children were drawn (ignored when ``q is None``).

    Returns:
        ``(outcome, residual)``: ``outcome`` is ``[k + 1]`` float64, the probability of accepting
        child ``j`` (first ``k`` entries) or rejecting all of them (last entry); ``residual`` is
        the ``[V]`` float64 distribution of the bonus token after rejecting all children.
    """
    walk = _ChildWalk(p, q, scheme)
    k = len(child_tokens)
    outcome = torch.zeros(k + 1, dtype=torch.float64)
    reach = 1.0
    for j, x in enumerate(child_tokens):
        accept = walk.accept_prob(x)
        outcome[j] = reach * accept
        reach *= 1.0 - accept
        if reach <= 0.0:
            break  # every later outcome has probability zero
        walk.reject(x)
    outcome[k] = max(reach, 0.0)
    return outcome, walk.cur


def node_accept_probs(
    tree: DraftTree, target_probs: torch.Tensor, scheme: SamplingScheme = "without_replacement"
) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """Per-node residual probabilities for :func:`~dyntree.common.verify.sampling_accept`.

    At every node with children, the children are walked in order as the sequential rule says:
    child ``j`` with token ``x_j`` gets ``p[child] = p_j(x_j)`` and ``q[child] = q_j(x_j)`` (1 for
    point-mass proposals), where ``p_j``/``q_j`` are the target/draft distributions left after
    rejecting children ``1..j-1``. These do not depend on any random draw, so all of them can be
    computed up front (on the device, by a GPU engine) and ``coin < min(1, p/q)`` tested per
    node. Returns ``(p [N], q [N], residual)`` (float64; root entries 1) where ``residual[i]``
    is the bonus distribution at node ``i`` after all its children are rejected (only nodes with
    children are listed; at a leaf the bonus is drawn from the target's own row).
    """
    n = tree.size
    if target_probs.dim() != 2 or target_probs.shape[0] != n:
        raise ValueError(
            f"target_probs must have shape [{n}, V] (one row per tree node), got {tuple(target_probs.shape)}"
        )
    dists = tree.draft_dists
    if dists is not None and dists.shape[1] != target_probs.shape[1]:
        raise ValueError(
            f"tree.draft_dists has vocab {dists.shape[1]}, target_probs has {target_probs.shape[1]}"
        )
    children: dict[int, list[int]] = {}
    for i, par in enumerate(tree.parents.tolist()[1:], start=1):
        children.setdefault(par, []).append(i)
    tokens = tree.tokens.tolist()
    p_node = torch.ones(n, dtype=torch.float64)
    q_node = torch.ones(n, dtype=torch.float64)
    residual: dict[int, torch.Tensor] = {}
    for node, kids in children.items():
        walk = _ChildWalk(target_probs[node], dists[node] if dists is not None else None, scheme)
        for c in kids:
            x = tokens[c]
            walk.accept_prob(x)  # validates the token (and a stochastic child's draft mass)
            p_node[c] = float(walk.cur[x])
            q_node[c] = float(walk.q[x]) if walk.q is not None else 1.0
            walk.reject(x)
        residual[node] = walk.cur
    return p_node, q_node, residual


def sample_verify(
    tree: DraftTree,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    scheme: SamplingScheme = "without_replacement",
) -> VerifyResult:
    """Lossless stochastic verification of one draft tree.

    Args:
        tree: the draft tree; with ``draft_dists`` its children are treated as drawn by
            ``scheme`` from ``draft_dists[parent]``, without it as point-mass proposals.
        target_probs: ``[N, V]``; row ``i`` is the target's (processed) distribution of the token
            after node ``i``.
        generator: random source for the accept coins and the bonus draw (CPU).
        scheme: ``"without_replacement"`` (RSD) or ``"iid"`` (SpecInfer).

    Returns:
        The accepted path (root first) and the committed tokens (accepted drafts + one more).

    One coin per node (:func:`node_accept_probs`, then
    :func:`~dyntree.common.verify.sampling_accept`): with independent coins, taking the
    lowest-index passing child is the same law as trying the children one after another.
    """
    p_node, q_node, residual = node_accept_probs(tree, target_probs, scheme)
    coins = torch.rand(tree.size, generator=generator, dtype=torch.float64)
    index, length = sampling_accept(tree.parents[None], p_node[None], q_node[None], coins[None])
    path = index[0, : int(length[0])].tolist()
    end = path[-1]
    bonus = _categorical(residual[end] if end in residual else target_probs[end], generator)
    return VerifyResult(path, tree.tokens[path[1:]].tolist() + [bonus])
