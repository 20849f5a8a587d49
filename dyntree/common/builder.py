"""Drafter-agnostic draft-tree builder: ``chain``, ``static`` and entropy-driven ``dyntree``.

A drafter that can score arbitrary frontier nodes supplies ``expand``: given frontier node
indices of the tree under construction (and the :class:`PartialTree` itself, for the tokens along
each node's path) and ``k``, it returns the top-``k`` :class:`~dyntree.common.drafter.Candidates`
(token ids, draft probabilities, and each row's entropy) of the token after each frontier node, in
ONE batched call per depth. The builder never touches the whole vocabulary. It grows the tree
from the root, depth by depth:

* ``chain``: one child per depth (top-1, or one sample), ``min(max_nodes, max_depth)`` long.
* ``static``: a fixed shape of rank paths (default: Medusa's 63-node ``mc_sim_7b_63``) truncated
  to the first ``max_nodes`` paths no deeper than ``max_depth``; rank ``r`` = the ``r``-th most
  likely token (or, when sampling, the ``r``-th child drawn).
* ``dyntree``: a frontier node with draft entropy ``H`` may get up to ``k(H)`` children (one for a
  confident node, ``max_children`` for an uncertain one); a child is kept if its *path value* (the
  product of calibrated acceptance probabilities from the root, i.e. its chance of being
  accepted) reaches ``threshold``. When the calibration holds the drafter's measured
  :class:`~dyntree.common.calibration.AcceptanceTable`, the values already say what entropy and
  rank are worth: every node offers as many candidates as the table has ranks, and the values
  alone choose (the width follows the measured acceptance). So do drafters whose candidates are
  few and each backed by evidence (``candidates_per_node``: n-gram matches), where the entropy rule
  would only drop candidates worth having. Greedy trees are then trimmed to the ``max_nodes`` best nodes
  by path value: values never grow along a path, so the kept set is ancestor-closed and its total
  value (the expected number of accepted tokens) is the largest possible for the candidates seen.
* ``beam``: best-first by draft probability: every frontier node offers its top-``beam_topk``
  children, and the ``beam_width`` best by path probability (product of draft probabilities
  from the root) become the next frontier, until the node budget or ``max_depth`` (the Hydra and
  self-draft drafters' own trees). Deterministic even when sampling (point-mass proposals).

Sampling (``sampling=True``): children are *drawn* from the draft distribution, the candidates'
probabilities renormalised over the top ``max(k, sampling_support)`` (any proposal is lossless as
long as the verifier knows it exactly: the tree's ``draft_dists`` rows are that distribution), by
the scheme the verifier assumes (:mod:`dyntree.common.sampling`; default without replacement) and the tree
carries ``draft_dists``. How many children a node gets is decided *before* drawing them (from the
node's own distribution, its path value and the other frontier nodes, never from the drawn tokens
themselves), and drawn nodes are never trimmed afterwards: dropping a draw after looking at it
would bias the proposal and break losslessness. Greedy trees carry no ``draft_dists``; verified
with :func:`~dyntree.common.sampling.sample_verify` they are point-mass proposals (also lossless).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import torch

from dyntree.common.calibration import Calibrator
from dyntree.common.drafter import Candidates
from dyntree.common.options import SamplingScheme, TreeMode, TreeOptions
from dyntree.common.tree import DraftTree

__all__ = [
    "BuiltTree",
    "PartialTree",
    "TreeBuilder",
    "ExpandFn",
    "BatchExpandFn",
    "MEDUSA_63",
    "draw_children",
]

# Medusa's default tree (FasterDecoding/Medusa, medusa/model/medusa_choices.py, Apache-2.0):
# rank paths, each listed after its prefix.
MEDUSA_63: tuple[tuple[int, ...], ...] = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4),
    (2, 0), (0, 5), (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8),
    (0, 0, 2), (3, 0), (0, 9), (8,), (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0),
    (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0), (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3),
    (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0), (1, 4), (7, 0), (0, 1, 2), (2, 0, 0),
    (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1), (9, 0), (0, 6, 0),
    (0, 0, 0, 1), (1, 6), (0, 7, 0),
)  # fmt: skip


@dataclass
class PartialTree:
    """The tree under construction, as ``expand`` sees it (read-only for the drafter)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]

    def path_tokens(self, i: int) -> list[int]:
        """Tokens from the root (included) to node ``i`` (included)."""
        out = [self.tokens[i]]
        while i > 0:
            i = self.parents[i]
            out.append(self.tokens[i])
        return out[::-1]


ExpandFn = Callable[[list[int], PartialTree, int], Candidates]
BatchExpandFn = Callable[[list[list[int]], list[PartialTree], int], Sequence[Candidates]]


@dataclass(frozen=True)
class BuiltTree(DraftTree):
    """A :class:`DraftTree` plus what the builder knew about each node.

    Attributes:
        node_entropy: ``[N]`` entropy (nats) of the draft distribution each node was drawn from
            (root: 0); the calibrator's second feature. ``None`` when the drafter gave none (trees
            the calibration does not steer).
        values: ``[N]`` path values (root: 1). ``dyntree`` trees: products of calibrated
            acceptance probabilities, whose sum minus one is the expected number of accepted draft
            tokens; other modes, which the calibration does not steer: products of draft
            probabilities.
        ranks: ``[N]`` each node's rank among its parent's candidates (0 = the drafter's most
            likely; root: 0); the calibration's third feature.
    """

    node_entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None
    ranks: torch.Tensor | None = None

    @property
    def expected_accepted(self) -> float:
        return float(self.values[1:].sum()) if self.values is not None else 0.0


def draw_children(
    q: torch.Tensor, counts: Sequence[int], scheme: SamplingScheme, generator: torch.Generator | None
) -> list[list[int]]:
    """Draw ``counts[f]`` children from row ``f`` of ``q`` (``[F, V]``, unnormalised), in drawing
    order; returns column indices.

    ``without_replacement``: Gumbel-top-k, which is distributed exactly as drawing one token at a
    time and renormalising over the tokens not yet drawn. ``iid``: independent draws.
    """
    f = q.shape[0]
    if len(counts) != f:
        raise ValueError(f"counts has {len(counts)} entries for {f} distribution rows")
    m = max(counts, default=0)
    if m == 0:
        return [[] for _ in range(f)]
    qd = q.double()
    if scheme == "without_replacement":
        u = torch.rand(qd.shape, generator=generator, device=q.device, dtype=torch.float64)
        keys = torch.log(qd) - torch.log(-torch.log(u.clamp_min(1e-300)))
        picks = torch.topk(keys, m, dim=-1).indices
    elif scheme == "iid":
        cdf = qd.cumsum(-1)
        u = torch.rand((f, m), generator=generator, device=q.device, dtype=torch.float64) * cdf[:, -1:]
        picks = torch.searchsorted(cdf, u, right=True).clamp(max=q.shape[1] - 1)
    else:
        raise ValueError(f"scheme must be 'without_replacement' or 'iid', got {scheme!r}")
    rows = picks.tolist()
    return [rows[i][: counts[i]] for i in range(f)]


class _Rows(NamedTuple):
    """One tree's candidates at one depth, checked: tensors, and the same as Python lists (a tree's
    rows are a few dozen numbers, which a list pass reads faster than a tensor operation each)."""

    ids: torch.Tensor
    probs: torch.Tensor
    ents: torch.Tensor | None  # None: the drafter gave no entropies (trees that read none)
    id_list: list[list[int]]
    p_list: list[list[float]]
    e_list: list[float]  # zeros without entropies (recorded, never read)


def _depth_first(keep: list[int], parents: list[int]) -> list[int]:
    """``keep`` (ancestor-closed, root first) in depth-first order, each node's children in their
    order in ``keep`` (the builder adds a node's children likeliest first). The chain of first
    children, the drafter's likeliest path, then comes first: when the target accepts it, the
    accepted nodes already sit in the slots after the committed tokens and no KV moves."""
    children: dict[int, list[int]] = {i: [] for i in keep}
    for i in keep[1:]:
        children[parents[i]].append(i)
    order, stack = [], [keep[0]]
    while stack:
        i = stack.pop()
        order.append(i)
        stack.extend(reversed(children[i]))
    return order


@dataclass
class _Growth:
    """Mutable state of one tree being grown."""

    max_nodes: int
    max_depth: int
    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    depths: list[int] = field(default_factory=lambda: [0])
    probs: list[float] = field(default_factory=lambda: [1.0])
    ents: list[float] = field(default_factory=lambda: [0.0])
    values: list[float] = field(default_factory=lambda: [1.0])
    ranks: list[int] = field(default_factory=lambda: [0])
    shape_path: list[tuple[int, ...]] = field(default_factory=lambda: [()])
    dists: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)  # sampling: support, probs
    logp: list[float] = field(default_factory=lambda: [0.0])  # beam: path log draft probability
    frontier: list[int] = field(default_factory=lambda: [0])
    depth: int = 0
    entropies: bool = True  # every node's entropy is known (the drafter gave them)

    def partial(self) -> PartialTree:
        return PartialTree(self.tokens, self.parents, self.depths)

    def add(self, parent: int, token: int, prob: float, ent: float, rank: int, value: float | None = None,
            shape: tuple[int, ...] = ()) -> int:
        """Add a node; its path value is ``value`` (calibrated: ``dyntree``) or, by default, the
        parent's times ``prob``: the path's product of draft probabilities."""
        self.logp.append(self.logp[parent] + math.log(max(prob, 1e-30)))
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.probs.append(prob)
        self.ents.append(ent)
        self.values.append(self.values[parent] * prob if value is None else value)
        self.ranks.append(rank)
        self.shape_path.append(shape)
        return len(self.tokens) - 1

    @property
    def drafted(self) -> int:
        return len(self.tokens) - 1


class TreeBuilder:
    """Builds draft trees from a drafter's ``expand`` and learns acceptance online.

    Args:
        options: tree shape options (defaults work out of the box).
        calibrator: shared acceptance calibration (a new identity map by default).
        candidates_per_node: ``dyntree`` offers this many candidates of every node and lets the
            values choose, instead of the entropy rule's ``k(H)`` (the drafter's
            :attr:`~dyntree.common.drafter.Drafter.candidates_per_node`; an acceptance table's
            ranks take precedence).
    """

    def __init__(self, options: TreeOptions | None = None, calibrator: Calibrator | None = None,
                 candidates_per_node: int | None = None) -> None:
        if candidates_per_node is not None and candidates_per_node < 1:
            raise ValueError(f"candidates_per_node must be >= 1, got {candidates_per_node}")
        self.options = options or TreeOptions()
        self.calibrator = calibrator or Calibrator(self.options.calibration)
        self.candidates_per_node = candidates_per_node
        self._columns: dict[int, torch.Tensor] = {}  # k -> arange(k): the ranks of k candidate columns

    # -- public API -----------------------------------------------------------------------------
    def build(
        self,
        root: int,
        expand: ExpandFn,
        *,
        max_nodes: int,
        max_depth: int,
        mode: TreeMode = "dyntree",
        sampling: bool = False,
        generator: torch.Generator | None = None,
        vocab_size: int | None = None,
    ) -> BuiltTree:
        """One tree rooted at ``root`` within ``max_nodes`` / ``max_depth`` (see :meth:`build_batch`)."""

        def batch_expand(frontiers: list[list[int]], partials: list[PartialTree], k: int) -> list[Candidates]:
            return [expand(frontiers[0], partials[0], k)]

        return self.build_batch([root], batch_expand, budgets=[(max_nodes, max_depth)], mode=mode, sampling=sampling,
                                generator=generator, vocab_size=vocab_size)[0]  # fmt: skip

    def build_batch(
        self,
        roots: Sequence[int],
        expand: BatchExpandFn,
        *,
        budgets: Sequence[tuple[int, int]],
        mode: TreeMode,
        sampling: bool = False,
        generator: torch.Generator | None = None,
        vocab_size: int | None = None,
        beam: tuple[int | None, int | None] = (None, None),
    ) -> list[BuiltTree]:
        """Grow one tree per root, calling ``expand`` once per depth for all of them.

        Args:
            roots: each tree's root token (the request's last committed token).
            expand: ``expand(frontiers, partials, k) -> [Candidates]``: per tree, the top-``k``
                candidates after each of its frontier nodes (an empty frontier's entry is ignored).
            budgets: per tree ``(max_nodes, max_depth)``.
            mode: ``chain`` / ``static`` / ``dyntree`` / ``beam``.
            sampling: draw children by ``options.sampling_scheme`` and attach ``draft_dists``
                (``vocab_size`` columns; required then).
            generator: random source for sampling (CPU).
            vocab_size: the target's vocabulary; candidate ids must lie below it.
            beam: ``(width, topk)`` of ``beam`` trees (``None``: ``ceil(max_nodes / max_depth)``;
                ``topk`` = width).
        """
        o = self.options
        if len(budgets) != len(roots):
            raise ValueError(f"budgets has {len(budgets)} entries for {len(roots)} roots")
        if sampling and vocab_size is None and mode != "beam":
            raise ValueError("build_batch(sampling=True) needs vocab_size for the trees' draft_dists")
        sampling = sampling and mode != "beam"
        growths = []
        for r, root in enumerate(roots):
            n_max, d_max = budgets[r]
            if n_max < 0 or d_max < 0:
                raise ValueError(f"budgets[{r}] = {(n_max, d_max)}: max_nodes and max_depth must be >= 0")
            g = _Growth(n_max, d_max, [int(root)])
            if n_max == 0 or d_max == 0:
                g.frontier = []
            growths.append(g)
        shape = self._shape(mode)
        k = self._k(mode, shape, growths, beam)
        if sampling:
            k = max(k, o.sampling_support)
        while any(g.frontier for g in growths):
            frontiers = [list(g.frontier) for g in growths]
            outs = expand(frontiers, [g.partial() for g in growths], k)
            if len(outs) != len(growths):
                raise ValueError(f"expand returned {len(outs)} candidate sets for {len(growths)} trees")
            for b, (g, c) in enumerate(zip(growths, outs)):
                if not g.frontier:
                    continue
                rows = self._check(b, c, len(g.frontier), vocab_size, mode == "dyntree")
                g.entropies = g.entropies and rows.ents is not None
                if sampling:
                    for node, row_ids, row_p in zip(g.frontier, rows.id_list, rows.p_list):
                        g.dists[node] = (row_ids, row_p)
                g.depth += 1
                if mode == "chain":
                    self._grow_chain(g, rows, sampling, generator)
                elif mode == "static":
                    self._grow_static(g, rows, shape, sampling, generator)
                elif mode == "beam":
                    self._grow_beam(g, rows, beam)
                else:
                    self._grow_dyntree(g, rows, sampling, generator)
                if g.depth >= g.max_depth or g.drafted >= g.max_nodes and (sampling or mode != "dyntree"):
                    g.frontier = []
        return [self._finish(g, sampling, vocab_size, mode) for g in growths]

    def observe(self, tree: DraftTree, accepted_nodes: Sequence[int]) -> int:
        """Feed one verification outcome to the calibrator; returns how many nodes were judged."""
        return self.calibrator.observe(tree, accepted_nodes)

    # -- growth rules ---------------------------------------------------------------------------
    def _shape(self, mode: TreeMode) -> tuple[tuple[int, ...], ...]:
        if mode == "static":
            return self.options.static_shape or MEDUSA_63
        return ()

    def _k(self, mode: TreeMode, shape: tuple[tuple[int, ...], ...], growths: list[_Growth],
           beam: tuple[int | None, int | None]) -> int:
        """Candidates per frontier row the mode can use."""
        if mode == "chain":
            return 1
        if mode == "static":
            return max((p[-1] + 1 for p in shape), default=1)
        if mode == "beam":
            return max((self._beam(g, beam)[1] for g in growths), default=1)
        return self._offered() or self.options.max_children

    def _offered(self) -> int | None:
        """Candidates every dyntree node offers when the values alone choose (``None``: k(H))."""
        table = self.calibrator.table
        return table.ranks if table is not None else self.candidates_per_node

    @staticmethod
    def _beam(g: _Growth, beam: tuple[int | None, int | None]) -> tuple[int, int]:
        width = beam[0] or max(1, math.ceil(g.max_nodes / max(g.max_depth, 1)))
        return width, beam[1] or width

    @staticmethod
    def _check(b: int, c: Candidates, rows: int, vocab: int | None, need_entropy: bool) -> _Rows:
        """The candidates of tree ``b`` on the CPU, checked."""
        if not isinstance(c, Candidates) or c.ids.shape[0] != rows:
            got = tuple(c.ids.shape) if isinstance(c, Candidates) else type(c).__name__
            raise ValueError(f"expand output for tree {b} must be Candidates with {rows} rows, got {got}")
        if c.entropy is None and need_entropy:
            raise ValueError(f"expand output for tree {b}: dyntree trees need the rows' entropies, got none")
        ids, probs = c.ids.cpu(), c.probs.float().cpu()
        ents = None if c.entropy is None else c.entropy.float().cpu()
        id_list, p_list = ids.tolist(), probs.tolist()
        if not all(x >= 0 for row in p_list for x in row):  # a negative entry or a NaN fails it
            raise ValueError(f"expand output for tree {b}: candidate probabilities must be >= 0 (no NaN)")
        top = vocab if vocab is not None else math.inf
        if not all(0 <= t < top for i_row, p_row in zip(id_list, p_list) for t, x in zip(i_row, p_row) if x > 0):
            raise ValueError(f"expand output for tree {b}: candidate token ids must lie in [0, {vocab})")
        return _Rows(ids, probs, ents, id_list, p_list, [0.0] * rows if ents is None else ents.tolist())

    def _values(self, g: _Growth, nodes: list[int], conf: torch.Tensor, ents: torch.Tensor,
                ranks: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """``[F, k]`` path values of children with confidences ``conf`` (``[F, k]``) under
        ``nodes`` (``F`` parents whose draft entropies are ``ents``), at depth ``g.depth``;
        ``ranks``: the children's candidate ranks (default: their columns, 0..k-1)."""
        k = conf.shape[1]
        if ranks is None:  # the columns' ranks, made once per width
            ranks = self._columns.get(k)
            if ranks is None:
                ranks = self._columns[k] = torch.arange(k)
        cal = self.calibrator.predict(g.depth, conf, ents.reshape(-1, 1), ranks)
        return torch.tensor([[g.values[i]] for i in nodes]) * cal

    def _draw(self, probs: torch.Tensor, counts: Sequence[int], gen: torch.Generator | None) -> list[list[int]]:
        return draw_children(probs, counts, self.options.sampling_scheme, gen)

    def _grow_chain(self, g: _Growth, rows: _Rows, sampling: bool, gen: torch.Generator | None) -> None:
        node = g.frontier[0]
        g.frontier = []
        row = rows.p_list[0]
        if not any(x > 0 for x in row):
            return
        j = self._draw(rows.probs[:1], [1], gen)[0][0] if sampling else 0
        p = float(rows.probs[0, j] / rows.probs[0].sum()) if sampling else row[j]
        g.frontier = [g.add(node, rows.id_list[0][j], p, rows.e_list[0], j)]

    def _grow_static(self, g: _Growth, rows: _Rows, shape: tuple[tuple[int, ...], ...], sampling: bool,
                     gen: torch.Generator | None) -> None:
        probs = rows.probs
        allowed = [p for p in shape if len(p) <= g.max_depth][: g.max_nodes]
        allowed_set = set(allowed)
        support = [sum(x > 0 for x in row) for row in rows.p_list]
        child_ranks = []
        for node, n_support in zip(g.frontier, support):
            base = g.shape_path[node]
            ranks = sorted(p[-1] for p in allowed_set if len(p) == len(base) + 1 and p[:-1] == base)
            child_ranks.append(ranks[:n_support] if sampling else [r for r in ranks if r < n_support])
        if sampling:
            cols = self._draw(probs, [len(r) for r in child_ranks], gen)
            probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-30)
        else:
            cols = child_ranks
        new = []
        for f, (node, ranks, col) in enumerate(zip(g.frontier, child_ranks, cols)):
            if not col:
                continue
            for r, j, c in zip(ranks, col, probs[f, col].tolist()):
                path = g.shape_path[node] + (r,)
                child = g.add(node, rows.id_list[f][j], c, rows.e_list[f], j, shape=path)
                if any(len(p) == len(path) + 1 and p[:-1] == path for p in allowed_set):
                    new.append(child)
        g.frontier = new

    def _grow_beam(self, g: _Growth, rows: _Rows, beam: tuple[int | None, int | None]) -> None:
        width, topk = self._beam(g, beam)
        room = g.max_nodes - g.drafted
        cands = [(g.logp[node] + math.log(p), f, j) for f, (node, row) in enumerate(zip(g.frontier, rows.p_list))
                 for j, p in enumerate(row[:topk]) if p > 0]
        cands.sort(key=lambda c: -c[0])  # stable: frontier order, then rank
        keep = cands[: min(width, room)]
        frontier = list(g.frontier)
        g.frontier = [g.add(frontier[f], rows.id_list[f][j], rows.p_list[f][j], rows.e_list[f], j) for _, f, j in keep]

    def _max_children(self, ents: torch.Tensor) -> torch.Tensor:
        o = self.options
        if o.entropy_high <= o.entropy_low:
            frac = (ents > o.entropy_low).float()
        else:
            frac = ((ents - o.entropy_low) / (o.entropy_high - o.entropy_low)).clamp(0, 1)
        return 1 + torch.round(frac * (o.max_children - 1)).long()

    def _grow_dyntree(self, g: _Growth, rows: _Rows, sampling: bool, gen: torch.Generator | None) -> None:
        o = self.options
        probs, ents = rows.probs, rows.ents
        assert ents is not None  # _check: dyntree candidates come with entropies
        offered = self._offered()
        k = torch.full_like(ents, offered, dtype=torch.int64) if offered is not None else self._max_children(ents)
        k = torch.minimum(k, (probs > 0).sum(-1))  # draws without replacement need that many tokens with mass
        kmax = min(int(k.max()) if k.numel() else 0, probs.shape[1])
        if kmax == 0:
            g.frontier = []
            return
        q = probs / probs.sum(-1, keepdim=True).clamp_min(1e-30) if sampling else probs
        top_p = q[:, :kmax]
        # Candidate values from the top-k draft probabilities: exact for greedy children, and an
        # estimate made before drawing for sampled ones.
        vals = self._values(g, g.frontier, top_p, ents)
        ok = (torch.arange(kmax)[None, :] < k[:, None]) & (top_p > 0) & (vals >= o.threshold)
        flat_v = torch.where(ok, vals, torch.full_like(vals, -1.0)).flatten()
        room = g.max_nodes - g.drafted if sampling else g.max_nodes  # greedy: trimmed at the end
        take = min(int(ok.sum()), room)
        chosen = sorted(torch.topk(flat_v, take).indices.tolist()) if take > 0 else []
        new: list[tuple[float, int]] = []
        if sampling:
            counts = torch.bincount(torch.tensor(chosen, dtype=torch.int64) // kmax, minlength=len(g.frontier))
            drawn = self._draw(probs, counts.tolist(), gen)
            for f, (node, cols) in enumerate(zip(g.frontier, drawn)):
                if not cols:
                    continue
                conf = q[f, cols]
                child_vals = self._values(g, [node], conf[None], ents[f : f + 1], cols)[0]
                for j, c, v in zip(cols, conf.tolist(), child_vals.tolist()):
                    new.append((v, g.add(node, rows.id_list[f][j], c, rows.e_list[f], j, v)))
        else:  # greedy children are the chosen candidates themselves: their values are known
            v_list = vals.tolist()
            for c in chosen:  # sorted: parents in frontier order, each one's children in rank order
                f, j = divmod(c, kmax)
                new.append((v_list[f][j], g.add(g.frontier[f], rows.id_list[f][j], rows.p_list[f][j], rows.e_list[f],
                                                j, v_list[f][j])))
        new.sort(key=lambda t: (-t[0], t[1]))
        g.frontier = [i for v, i in new[: o.max_frontier] if v >= o.threshold]
        if not sampling and g.frontier and g.drafted >= g.max_nodes:
            # A descendant's value is at most its ancestor's, and it comes later (ties lose): below a
            # frontier node worth no more than the N-th best node so far, nothing can make the final
            # cut, so that node is not expanded at all.
            cut = sorted(g.values[1:], reverse=True)[g.max_nodes - 1]
            g.frontier = [i for i in g.frontier if g.values[i] > cut]

    # -- assembly -------------------------------------------------------------------------------
    def _finish(self, g: _Growth, sampling: bool, vocab: int | None, mode: TreeMode) -> BuiltTree:
        keep = list(range(len(g.tokens)))
        if not sampling and mode == "dyntree" and g.drafted > g.max_nodes:
            order = sorted(range(1, len(g.tokens)), key=lambda i: (-g.values[i], i))
            keep = [0] + sorted(order[: g.max_nodes])
        keep = _depth_first(keep, g.parents)
        remap = {old: new for new, old in enumerate(keep)}
        parents = [-1] + [remap[g.parents[i]] for i in keep[1:]]
        dists = None
        if sampling and vocab is not None and g.dists:
            dists = torch.zeros(len(keep), vocab)
            for old, (row_ids, row_p) in g.dists.items():
                if old in remap:
                    p = torch.tensor(row_p)
                    dists[remap[old]].index_add_(0, torch.tensor(row_ids), p / p.sum().clamp_min(1e-30))
        return BuiltTree(
            torch.tensor([g.tokens[i] for i in keep], dtype=torch.int64),
            torch.tensor(parents, dtype=torch.int64),
            torch.tensor([g.probs[i] for i in keep], dtype=torch.float32).clamp(0, 1),
            dists,
            node_entropy=torch.tensor([g.ents[i] for i in keep], dtype=torch.float32) if g.entropies else None,
            values=torch.tensor([g.values[i] for i in keep], dtype=torch.float32),
            ranks=torch.tensor([g.ranks[i] for i in keep], dtype=torch.int64),
        )
