"""Online calibration: draft confidence (and entropy) -> measured acceptance probability.

The dynamic tree builder values a branch by the product of per-node acceptance probabilities.
A drafter's own probability for a token is a biased estimate of the chance the target accepts it
(over- or under-confident, and differently at different depths), so :class:`Calibrator` learns a
correction per ``(depth, entropy bin, confidence bin)`` from verification outcomes:

    predict(depth, conf, H) = clamp(conf + R / (W + prior_strength), 0, 1)

where ``W`` is the (decayed) number of observations in the bin and ``R`` the (decayed) sum of
``accepted - conf`` over them. With no data this is the identity map ``conf``; with plenty it is
the bin's measured acceptance rate plus the within-bin slope of ``conf``.

An observation is a draft node whose parent was on the accepted path (so the target did judge
it): ``accepted`` says whether the node itself was accepted. Nodes below a rejected node carry
no information and are skipped.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dyntree.common.options import CalibrationOptions
from dyntree.common.tree import DraftTree

__all__ = ["Calibrator", "entropy"]


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats over the last dimension (``0 log 0 = 0``)."""
    p = probs.float()
    return -(p * torch.log(p.clamp_min(1e-30))).sum(-1)


class Calibrator:
    """Per-depth map from (draft confidence, draft entropy) to acceptance probability."""

    def __init__(self, options: CalibrationOptions | None = None) -> None:
        self.options = options or CalibrationOptions()
        o = self.options
        self._edges = torch.tensor(o.entropy_edges, dtype=torch.float32)
        shape = (o.max_depth, len(o.entropy_edges) + 1, o.confidence_bins)
        self.weight = torch.zeros(shape, dtype=torch.float64)
        self.residual = torch.zeros(shape, dtype=torch.float64)
        self.observations = 0

    def _bins(self, depth: torch.Tensor, conf: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
        o = self.options
        depth = torch.as_tensor(depth, dtype=torch.int64).cpu()
        conf = torch.as_tensor(conf, dtype=torch.float32).cpu()
        ent = torch.as_tensor(ent, dtype=torch.float32).cpu().contiguous()
        if not (depth.shape == conf.shape == ent.shape):
            raise ValueError(
                f"depth, conf and entropy must have one shape, got {tuple(depth.shape)}, "
                f"{tuple(conf.shape)}, {tuple(ent.shape)}"
            )
        if bool((depth < 1).any()):
            raise ValueError("depth must be >= 1 (draft nodes; the root is not calibrated)")
        d = depth.clamp(max=o.max_depth) - 1
        e = torch.bucketize(ent, self._edges, right=True)
        c = (conf.clamp(0, 1) * o.confidence_bins).long().clamp(max=o.confidence_bins - 1)
        n_e, n_c = len(o.entropy_edges) + 1, o.confidence_bins
        return (d * n_e + e) * n_c + c

    def predict(self, depth: torch.Tensor, conf: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
        """Calibrated acceptance probability, same shape as ``conf`` (float32, CPU)."""
        flat = self._bins(depth, conf, ent)
        w = self.weight.view(-1)[flat]
        r = self.residual.view(-1)[flat]
        conf64 = torch.as_tensor(conf, dtype=torch.float64).cpu()
        return (conf64 + r / (w + self.options.prior_strength)).clamp(0, 1).float()

    def update(self, depth: torch.Tensor, conf: torch.Tensor, ent: torch.Tensor, accepted: torch.Tensor) -> None:
        """Fold in observations: each judged draft node and whether the target accepted it."""
        flat = self._bins(depth, conf, ent)
        acc = torch.as_tensor(accepted).cpu().to(torch.float64)
        if acc.shape != flat.shape:
            raise ValueError(f"accepted must have shape {tuple(flat.shape)}, got {tuple(acc.shape)}")
        n = flat.numel()
        if n == 0:
            return
        keep = self.options.decay**n
        self.weight.mul_(keep)
        self.residual.mul_(keep)
        conf64 = torch.as_tensor(conf, dtype=torch.float64).cpu().clamp(0, 1)
        self.weight.view(-1).index_add_(0, flat, torch.ones(n, dtype=torch.float64))
        self.residual.view(-1).index_add_(0, flat, acc - conf64)
        self.observations += n

    def observe(
        self, tree: DraftTree, accepted_nodes: Sequence[int], node_entropy: torch.Tensor | None = None
    ) -> int:
        """Learn from one verified tree; returns how many nodes were judged.

        Args:
            tree: the verified tree (``draft_probs`` are the confidences).
            accepted_nodes: the verifier's accepted path, root first.
            node_entropy: ``[N]`` entropy of the distribution each node was drawn from (its
                parent's draft distribution). Defaults to ``tree.node_entropy`` (trees from
                :class:`~dyntree.common.builder.TreeBuilder`) or is computed from
                ``tree.draft_dists``.
        """
        if node_entropy is None:
            node_entropy = getattr(tree, "node_entropy", None)
        if node_entropy is None and tree.draft_dists is not None and tree.size > 1:
            node_entropy = torch.zeros(tree.size)
            node_entropy[1:] = entropy(tree.draft_dists.cpu()[tree.parents[1:]])
        if node_entropy is None:
            raise ValueError(
                "node_entropy is required for a tree without node_entropy or draft_dists "
                "(build it with TreeBuilder or pass the entropies)"
            )
        if node_entropy.shape != (tree.size,):
            raise ValueError(f"node_entropy must have shape [{tree.size}], got {tuple(node_entropy.shape)}")
        on_path = torch.zeros(tree.size, dtype=torch.bool)
        on_path[list(accepted_nodes)] = True
        if tree.size == 1:
            return 0
        judged = torch.zeros(tree.size, dtype=torch.bool)
        judged[1:] = on_path[tree.parents[1:]]
        idx = torch.nonzero(judged).flatten()
        self.update(tree.depths[idx], tree.draft_probs[idx].cpu(), node_entropy.cpu()[idx], on_path[idx])
        return int(idx.numel())
