"""Calibration: draft confidence (rank, entropy) -> the chance the target accepts a draft node.

The dynamic tree builder values a branch by the product of per-node acceptance probabilities.
A drafter's own probability for a token is a biased estimate of the chance the target accepts it
(over- or under-confident, differently at different depths, and for trained heads often no better
than the candidate's rank), so the estimate has two parts:

* a *base* estimate: the drafter's :class:`AcceptanceTable` when it ships one (acceptance measured
  offline per ``(depth, rank, confidence bin)`` on held-out data, e.g. Hydra heads on held-out
  training sequences), else the confidence itself;
* an online correction per ``(depth, entropy bin, confidence bin, rank)`` learned by
  :class:`Calibrator` from verification outcomes::

    predict(depth, conf, H, rank) = clamp(base * (A + s * b * P) / (E + s * b), 0, 1),  b = E / W

  where ``W`` is the (decayed) number of observations in the bin, ``A`` the (decayed) number
  accepted, ``E`` the (decayed) sum of their base estimates and ``s`` = ``prior_strength``
  pseudo-observations at the *parent* ratio ``P``, the same ratio pooled more widely, down to the
  ratio over everything (whose parent is 1). With a table, whose base already prices ranks, the
  parent is the ratio pooled over the bin's depth (what drifts on new prompts is each depth's
  level). Without one, it is the ratio pooled over the bin's depth and rank, whose parent is the
  rank's ratio over all depths: the bare confidence ignores rank, and a near-exact self-draft's
  first choices are underconfident at every depth while its runner-ups are overconfident. So with
  no data at all this is the base estimate; a bin without data of its own starts from what its
  wider pool measured (a short run never fills the deep bins one by one); with plenty, the bin's
  base scaled so that it predicts the bin's
  measured acceptance rate. The correction is a ratio,
  not an offset: it keeps the base's order inside a bin, where candidates of probability 0.002
  and 0.08 share the lowest confidence bin (an offset there raised or zeroed them alike, and
  wide trees lost the candidates worth most: Hydra, 64 nodes, tau 2.92 with the offset, 3.01
  without any correction).

An observation is a draft node whose parent was on the accepted path (so the target did judge
it): ``accepted`` says whether the node itself was accepted. Nodes below a rejected node carry
no information and are skipped.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from dyntree.common.options import CalibrationOptions
from dyntree.common.tree import DraftTree

__all__ = ["AcceptanceTable", "CONFIDENCE_EDGES", "Calibrator", "bin_confidence", "entropy"]

#: Confidence bin edges of measured acceptance tables: most candidates below rank 0 have draft
#: probabilities under 0.1, where acceptance still grows about in proportion to them.
CONFIDENCE_EDGES: tuple[float, ...] = (0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                                       0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats over the last dimension (``0 log 0 = 0``)."""
    p = probs.float()
    return -(p * torch.log(p.clamp_min(1e-30))).sum(-1)


def bin_confidence(conf: torch.Tensor, edges: Sequence[float] | torch.Tensor = CONFIDENCE_EDGES) -> torch.Tensor:
    """Each confidence's bin among those that ``edges`` (increasing inner edges) split [0, 1] into:
    int64, same shape; bin ``i`` holds ``edges[i-1] <= conf < edges[i]``."""
    return torch.bucketize(torch.as_tensor(conf, dtype=torch.float32), torch.as_tensor(edges, dtype=torch.float32),
                           right=True)


@dataclass(frozen=True)
class AcceptanceTable:
    """Measured acceptance of a drafter's candidates: ``acceptance[d - 1, r, c]`` is the chance that
    the rank-``r`` candidate (0 = most likely) at depth ``d`` whose draft probability falls in
    confidence bin ``c`` is the target's token, given that its parent is. The bins split [0, 1] at
    ``edges`` (default :data:`CONFIDENCE_EDGES`: fine at low confidence, where most candidates
    below rank 0 lie and acceptance still varies tenfold); a table without edges has equal-width
    bins. Deeper depths and lower ranks than the table holds use its last depth / rank.
    ``counts`` holds the observations behind each cell; ``source`` says where they came from
    (never evaluation data)."""

    acceptance: torch.Tensor  # [depths, ranks, confidence bins] float32
    counts: torch.Tensor  # same shape, int64
    source: str = ""
    edges: tuple[float, ...] | None = None  # inner bin edges, increasing in (0, 1); None: equal width

    def __post_init__(self) -> None:
        a, c = self.acceptance, self.counts
        if a.dim() != 3 or c.shape != a.shape or 0 in a.shape:
            raise ValueError(f"AcceptanceTable: acceptance {tuple(a.shape)} and counts {tuple(c.shape)} must be one "
                             "non-empty [depths, ranks, confidence_bins] shape")
        if not bool(((a >= 0) & (a <= 1)).all()):
            raise ValueError("AcceptanceTable: acceptance must lie in [0, 1]")
        e = self.edges
        if e is not None and (len(e) != a.shape[2] - 1 or any(not 0 < x < 1 for x in e)
                              or any(x >= y for x, y in zip(e, e[1:]))):
            raise ValueError(f"AcceptanceTable: {a.shape[2]} confidence bins need {a.shape[2] - 1} increasing "
                             f"edges in (0, 1), got {e}")

    def confidence_bin(self, conf: torch.Tensor) -> torch.Tensor:
        """Each confidence's bin (int64, same shape)."""
        return bin_confidence(conf, self.edge_tensor)

    @functools.cached_property
    def edge_tensor(self) -> torch.Tensor:
        """The inner bin edges (float32): ``edges``, else the equal-width ones."""
        n_c = self.acceptance.shape[2]
        return torch.tensor(self.edges if self.edges is not None else [i / n_c for i in range(1, n_c)],
                            dtype=torch.float32)

    @property
    def ranks(self) -> int:
        return int(self.acceptance.shape[1])

    @classmethod
    def from_counts(cls, hits: torch.Tensor, counts: torch.Tensor, source: str = "", strength: float = 20.0,
                    edges: tuple[float, ...] | None = None) -> "AcceptanceTable":
        """A table from per-cell hits and observations: each cell's rate is shrunk toward its
        ``(depth, rank)`` rate with ``strength`` pseudo-observations (sparse cells follow the rank)."""
        hits, counts = hits.double(), counts.double()
        rank_rate = hits.sum(-1, keepdim=True) / counts.sum(-1, keepdim=True).clamp(min=1)
        rate = (hits + strength * rank_rate) / (counts + strength)
        return cls(rate.float().clamp(0, 1), counts.round().long(), source, edges)

    def lookup(self, depth: torch.Tensor, rank: torch.Tensor, conf: torch.Tensor) -> torch.Tensor:
        """The acceptance of candidates (tensors of one shape; float32)."""
        n_d, n_r, _ = self.acceptance.shape
        d = (torch.as_tensor(depth, dtype=torch.int64) - 1).clamp(0, n_d - 1)
        r = torch.as_tensor(rank, dtype=torch.int64).clamp(0, n_r - 1)
        return self.acceptance[d, r, self.confidence_bin(conf)]

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "shape": list(self.acceptance.shape),
                **({"confidence_edges": list(self.edges)} if self.edges is not None else {}),
                "acceptance": [round(x, 5) for x in self.acceptance.flatten().tolist()],
                "counts": self.counts.flatten().tolist()}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "AcceptanceTable":
        try:
            shape = tuple(int(x) for x in doc["shape"])
            acc = torch.tensor(doc["acceptance"], dtype=torch.float32).reshape(shape)
            counts = torch.tensor(doc["counts"], dtype=torch.int64).reshape(shape)
            edges = tuple(float(x) for x in doc["confidence_edges"]) if "confidence_edges" in doc else None
        except (KeyError, TypeError, RuntimeError, ValueError) as exc:
            raise ValueError(f"malformed acceptance table ({exc})") from None
        return cls(acc, counts, str(doc.get("source", "")), edges)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | Path) -> "AcceptanceTable":
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None


class Calibrator:
    """Per-depth map from (draft confidence, draft entropy, candidate rank) to acceptance
    probability: the drafter's :class:`AcceptanceTable` (or the confidence) corrected online.

    A prediction is one lookup in a grid over (depth, entropy bin, confidence bin, rank) made anew
    once ``options.refresh`` observations have come in since the last one; its confidence bins are
    those of the online statistics and of the table together (each edge of either), so one bin
    picks both the statistics' and the table's cell.
    """

    def __init__(self, options: CalibrationOptions | None = None, table: AcceptanceTable | None = None) -> None:
        self.table = table
        self.options = options or CalibrationOptions()
        o = self.options
        self._edges = torch.tensor(o.entropy_edges, dtype=torch.float32)
        shape = (o.max_depth, len(o.entropy_edges) + 1, o.confidence_bins, o.rank_bins)
        # W (observations), A (accepted among them), E (their base estimates, summed) per bin, as
        # one tensor: one decay and one scatter per update
        self._stats = torch.zeros((3, *shape), dtype=torch.float64)
        self.observations = 0
        own = torch.tensor([i / o.confidence_bins for i in range(1, o.confidence_bins)], dtype=torch.float32)
        edges = own if table is None else torch.cat([own, table.edge_tensor]).unique()  # sorted
        lows = torch.cat([torch.zeros(1), edges])  # each bin's lower edge
        self._conf_edges = edges
        self._conf_own = torch.bucketize(lows, own, right=True)  # the statistics' bin of each bin
        self._conf_table = None if table is None else table.confidence_bin(lows)
        # the grid covers the deeper and lower-ranked of the statistics and the table; each of its
        # cells reads one bin of the statistics (``_grid_bins``) and one cell of the table
        t_d, t_r = (table.acceptance.shape[0], table.ranks) if table is not None else (0, 0)
        self._depths, self._ranks = max(o.max_depth, t_d), max(o.rank_bins, t_r)
        d, e, c, r = torch.meshgrid(torch.arange(self._depths), torch.arange(len(o.entropy_edges) + 1),
                                    torch.arange(len(edges) + 1), torch.arange(self._ranks), indexing="ij")
        self._grid_bins = self._stats_bin(d, e, c, r)  # each grid cell's bin of the statistics
        self._grid_base = None if table is None else table.lookup(d + 1, r, lows[c]).double()  # and the table's estimate
        self._grid: torch.Tensor | None = None  # every cell's prediction, until the next refresh
        self._unseen = 0  # observations folded in since the grid was made

    def _coords(self, depth: int | torch.Tensor, conf: torch.Tensor, ent: torch.Tensor,
                rank: torch.Tensor | None) -> tuple[int | torch.Tensor, torch.Tensor, torch.Tensor,
                                                    int | torch.Tensor, torch.Tensor]:
        """``(depth - 1, entropy bin, confidence bin, rank, confidence clamped to [0, 1])`` of
        candidates, in shapes that broadcast (``depth``: a tensor or one int for all; ``rank``:
        default 0; ranks are not yet capped: :func:`_cap`). A tree builder predicts one depth's
        candidates a call: ``[F, k]`` confidences against ``[F, 1]`` entropies and ``[k]`` ranks."""
        conf = torch.as_tensor(conf, dtype=torch.float32).cpu().clamp(0, 1)
        ent = torch.as_tensor(ent, dtype=torch.float32).cpu().contiguous()
        r = 0 if rank is None else torch.as_tensor(rank, dtype=torch.int64).cpu()
        if isinstance(depth, int):
            low, d = depth, depth - 1
        else:
            depth = torch.as_tensor(depth, dtype=torch.int64).cpu()
            low, d = (int(depth.min()) if depth.numel() else 1), depth - 1
        if low < 1:
            raise ValueError("depth must be >= 1 (draft nodes; the root is not calibrated)")
        e = torch.bucketize(ent, self._edges, right=True)
        c = torch.bucketize(conf, self._conf_edges, right=True)
        shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else () for x in (d, conf, ent, r)]
        n = max(map(len, shapes))
        for dims in zip(*(s[::-1] + (1,) * (n - len(s)) for s in shapes)):  # right-aligned, as torch broadcasts
            if len(set(dims) - {1}) > 1:
                raise ValueError("depth, conf, entropy and rank must have one shape (or broadcast to one), got "
                                 + ", ".join(map(str, shapes)))
        return d, e, c, r, conf

    def _cell(self, d: int | torch.Tensor, e: torch.Tensor, c: torch.Tensor,
              r: int | torch.Tensor) -> tuple[int | torch.Tensor, torch.Tensor, torch.Tensor, int | torch.Tensor]:
        """The grid's index of candidates at :meth:`_coords` (depth and rank capped to the grid)."""
        return _cap(d, self._depths - 1), e, c, _cap(r, self._ranks - 1)

    def predict(self, depth: int | torch.Tensor, conf: torch.Tensor, ent: torch.Tensor,
                rank: torch.Tensor | None = None) -> torch.Tensor:
        """Calibrated acceptance probability (float32, CPU) in the shape the arguments broadcast to
        (see :meth:`_coords`). ``rank``: each candidate's rank among its siblings' candidates (0 =
        most likely; default 0)."""
        d, e, c, r, conf = self._coords(depth, conf, ent, rank)
        got = self._cells()[self._cell(d, e, c, r)]
        return got if self.table is not None else (conf * got).clamp_(0, 1)

    def _cells(self) -> torch.Tensor:
        """The grid of predictions ``[depth, entropy bin, confidence bin, rank]`` (float32): with a
        table, the table's estimate times the bin's ratio (clamped to [0, 1]); without, the ratio
        that multiplies the confidence."""
        if self._grid is None:
            ratio = self._bin_ratios().flatten()[self._grid_bins]
            grid = ratio if self._grid_base is None else (ratio * self._grid_base).clamp_(0, 1)
            self._grid = grid.float().view(self._grid_bins.shape)
        return self._grid

    def _stats_bin(self, d: int | torch.Tensor, e: torch.Tensor, c: torch.Tensor, r: int | torch.Tensor) -> torch.Tensor:
        """The statistics' flat bin of candidates at :meth:`_coords`."""
        o = self.options
        n_e = len(o.entropy_edges) + 1
        return ((e + _cap(d, o.max_depth - 1) * n_e) * o.confidence_bins + self._conf_own[c]) * o.rank_bins \
            + _cap(r, o.rank_bins - 1)

    def _bin_ratios(self) -> torch.Tensor:
        """Every bin's ratio ``[depth, entropy, confidence, rank]``, each shrunk toward its pooled
        parent (computed once per refresh of the grid)."""
        w, a, e = self._stats.unbind(0)
        n_d, n_r = w.shape[0], w.shape[-1]
        cells = [x.sum(dim=(1, 2)) for x in (w, a, e)]  # [depth, rank]
        overall = self._ratio(*(x.sum() for x in cells), torch.ones(()))
        if self.table is not None:  # the table prices ranks: what drifts is each depth's level
            by_depth = self._ratio(*(x.sum(1) for x in cells), overall.expand(n_d))
            parent = by_depth[:, None].expand(n_d, n_r)
        else:  # the bare confidence ignores rank, the largest error of a near-exact self-draft
            by_rank = self._ratio(*(x.sum(0) for x in cells), overall.expand(n_r))
            parent = self._ratio(*cells, by_rank.expand(n_d, n_r))
        return self._ratio(w, a, e, parent[:, None, None, :])

    def _ratio(self, w: torch.Tensor, a: torch.Tensor, e: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
        """Measured over predicted acceptance of ``w`` observations (``a`` accepted, base estimates
        summing to ``e``), shrunk toward ``parent`` by ``prior_strength`` pseudo-observations."""
        prior = self.options.prior_strength * (e / w.clamp(min=1e-12)).clamp(min=1e-4)
        return torch.where(w > 0, (a + prior * parent) / (e + prior), parent)

    def update(self, depth: torch.Tensor, conf: torch.Tensor, ent: torch.Tensor, accepted: torch.Tensor,
               rank: torch.Tensor | None = None) -> None:
        """Fold in observations: each judged draft node and whether the target accepted it."""
        d, e, c, r, conf = self._coords(depth, conf, ent, rank)
        cell = self._cell(d, e, c, r)
        flat = self._grid_bins[cell]
        acc = torch.as_tensor(accepted).cpu().to(torch.float64)
        if acc.shape != flat.shape:
            raise ValueError(f"accepted must have shape {tuple(flat.shape)}, got {tuple(acc.shape)}")
        n = flat.numel()
        if n == 0:
            return
        self._unseen += n
        if self._unseen >= self.options.refresh:
            self._grid, self._unseen = None, 0
        self._stats.mul_(self.options.decay**n)
        base = conf.double() if self._grid_base is None else self._grid_base[cell]
        seen = torch.stack([torch.ones(flat.shape, dtype=torch.float64), acc, base.expand(flat.shape)])
        self._stats.view(3, -1).index_add_(1, flat.reshape(-1), seen.view(3, -1))
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
        on_path = set(accepted_nodes)
        if on_path and (min(on_path) < 0 or max(on_path) >= tree.size):
            raise ValueError(f"accepted_nodes {list(accepted_nodes)} name nodes outside the tree of {tree.size}")
        parents = tree.parents.tolist()
        judged = [i for i in range(1, tree.size) if parents[i] in on_path]
        if not judged:
            return 0
        idx = torch.tensor(judged)
        ranks = getattr(tree, "ranks", None)
        self.update(tree.depths[idx], tree.draft_probs[idx].cpu(), node_entropy.cpu()[idx],
                    torch.tensor([i in on_path for i in judged]), ranks[idx] if ranks is not None else None)
        return len(judged)


def _cap(x: int | torch.Tensor, top: int) -> int | torch.Tensor:
    """``x`` clamped to ``[0, top]``: an int, or a tensor elementwise."""
    return min(max(x, 0), top) if isinstance(x, int) else x.clamp(0, top)
