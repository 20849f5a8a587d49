"""Drafter-agnostic draft-tree builder: ``chain``, ``static`` and entropy-driven ``dyntree``.

A drafter that can score arbitrary frontier nodes supplies ``expand``: given frontier node
indices of the tree under construction (and the :class:`PartialTree` itself, for the tokens along
each node's path) it returns ``[F, V]`` draft probabilities of the token after each frontier node,
in ONE batched call per depth. The builder grows the tree from the root, depth by depth:

* ``chain``: one child per depth (top-1, or one sample), ``min(max_nodes, max_depth)`` long.
* ``static``: a fixed shape of rank paths (default: Medusa's 63-node ``mc_sim_7b_63``) truncated
  to the first ``max_nodes`` paths no deeper than ``max_depth``; rank ``r`` = the ``r``-th most
  likely token (or, when sampling, the ``r``-th child drawn).
* ``dyntree``: a frontier node with draft entropy ``H`` may get up to ``k(H)`` children (one for a
  confident node, ``max_children`` for an uncertain one); a child is kept if its *path value* (the
  product of calibrated acceptance probabilities from the root, i.e. its chance of being
  accepted) reaches ``threshold``. Greedy trees are then trimmed to the ``max_nodes`` best nodes
  by path value: values never grow along a path, so the kept set is ancestor-closed and its total
  value (the expected number of accepted tokens) is the largest possible for the candidates seen.

Sampling (``sampling=True``): children are *drawn* from the draft distribution by the scheme the
verifier assumes (:mod:`dyntree.common.sampling`; default without replacement) and the tree
carries ``draft_dists``. How many children a node gets is decided *before* drawing them (from the
node's own distribution, its path value and the other frontier nodes, never from the drawn tokens
themselves), and drawn nodes are never trimmed afterwards: dropping a draw after looking at it
would bias the proposal and break losslessness. Greedy trees carry no ``draft_dists``; verified
with :func:`~dyntree.common.sampling.sample_verify` they are point-mass proposals (also lossless).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from dyntree.common.calibration import Calibrator, entropy
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


ExpandFn = Callable[[list[int], PartialTree], torch.Tensor]
BatchExpandFn = Callable[[list[list[int]], list[PartialTree]], Sequence[torch.Tensor]]


@dataclass(frozen=True)
class BuiltTree(DraftTree):
    """A :class:`DraftTree` plus what the builder knew about each node.

    Attributes:
        node_entropy: ``[N]`` entropy (nats) of the draft distribution each node was drawn from
            (root: 0); the calibrator's second feature.
        values: ``[N]`` calibrated path values (root: 1); their sum minus one is the expected
            number of accepted draft tokens.
    """

    node_entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None

    @property
    def expected_accepted(self) -> float:
        return float(self.values[1:].sum()) if self.values is not None else 0.0


def draw_children(
    q: torch.Tensor, counts: Sequence[int], scheme: SamplingScheme, generator: torch.Generator | None
) -> list[list[int]]:
    """Draw ``counts[f]`` children from row ``f`` of ``q`` (``[F, V]``), in drawing order.

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
    shape_path: list[tuple[int, ...]] = field(default_factory=lambda: [()])
    dists: dict[int, torch.Tensor] = field(default_factory=dict)
    frontier: list[int] = field(default_factory=lambda: [0])
    depth: int = 0

    def partial(self) -> PartialTree:
        return PartialTree(self.tokens, self.parents, self.depths)

    def add(self, parent: int, token: int, prob: float, ent: float, value: float, shape: tuple[int, ...] = ()) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.probs.append(prob)
        self.ents.append(ent)
        self.values.append(value)
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
    """

    def __init__(self, options: TreeOptions | None = None, calibrator: Calibrator | None = None) -> None:
        self.options = options or TreeOptions()
        self.calibrator = calibrator or Calibrator(self.options.calibration)

    # -- public API -----------------------------------------------------------------------------
    def build(
        self,
        root: int,
        expand: ExpandFn,
        *,
        max_nodes: int | None = None,
        max_depth: int | None = None,
        mode: TreeMode | None = None,
        sampling: bool = False,
        generator: torch.Generator | None = None,
    ) -> BuiltTree:
        """One tree rooted at ``root`` (see :meth:`build_batch`)."""

        def batch_expand(frontiers: list[list[int]], partials: list[PartialTree]) -> list[torch.Tensor]:
            return [expand(frontiers[0], partials[0])]

        budget = None if max_nodes is None and max_depth is None else [(max_nodes, max_depth)]
        return self.build_batch([root], batch_expand, budgets=budget, mode=mode, sampling=sampling, generator=generator)[0]

    def build_batch(
        self,
        roots: Sequence[int],
        expand: BatchExpandFn,
        *,
        budgets: Sequence[tuple[int | None, int | None]] | None = None,
        mode: TreeMode | None = None,
        sampling: bool = False,
        generator: torch.Generator | None = None,
    ) -> list[BuiltTree]:
        """Grow one tree per root, calling ``expand`` once per depth for all of them.

        Args:
            roots: each tree's root token (the request's last committed token).
            expand: ``expand(frontiers, partials) -> [Tensor[F_b, V]]``: per tree, draft
                probabilities of the next token after each frontier node (an empty frontier's
                entry is ignored).
            budgets: per tree ``(max_nodes, max_depth)``; ``None`` entries use the options.
            mode: ``chain`` / ``static`` / ``dyntree`` (default: ``options.mode``).
            sampling: draw children by ``options.sampling_scheme`` and attach ``draft_dists``.
            generator: random source for sampling (on the device of ``expand``'s outputs).
        """
        o = self.options
        mode = mode or o.mode
        if budgets is not None and len(budgets) != len(roots):
            raise ValueError(f"budgets has {len(budgets)} entries for {len(roots)} roots")
        growths = []
        for r, root in enumerate(roots):
            n_max, d_max = budgets[r] if budgets is not None else (None, None)
            n_max = o.max_nodes if n_max is None else n_max
            d_max = o.max_depth if d_max is None else d_max
            if n_max < 0 or d_max < 0:
                raise ValueError(f"budgets[{r}] = {(n_max, d_max)}: max_nodes and max_depth must be >= 0")
            g = _Growth(n_max, d_max, [int(root)])
            if n_max == 0 or d_max == 0:
                g.frontier = []
            growths.append(g)
        shape = self._shape(mode)
        vocab: int | None = None
        while any(g.frontier for g in growths):
            frontiers = [list(g.frontier) for g in growths]
            outs = expand(frontiers, [g.partial() for g in growths])
            if len(outs) != len(growths):
                raise ValueError(f"expand returned {len(outs)} tensors for {len(growths)} trees")
            for b, (g, q) in enumerate(zip(growths, outs)):
                if not g.frontier:
                    continue
                if not isinstance(q, torch.Tensor) or q.dim() != 2 or q.shape[0] != len(g.frontier):
                    got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
                    raise ValueError(f"expand output for tree {b} must be [{len(g.frontier)}, V], got {got}")
                if vocab is None:
                    vocab = q.shape[1]
                elif q.shape[1] != vocab:
                    raise ValueError(f"expand output for tree {b} has vocab {q.shape[1]}, earlier {vocab}")
                if not bool((q >= 0).all()):  # one pass: a negative entry or a NaN fails it
                    raise ValueError(f"expand output for tree {b} must be probabilities (>= 0, no NaN)")
                if sampling:
                    for node, row in zip(g.frontier, q):
                        g.dists[node] = row
                g.depth += 1
                if mode == "chain":
                    self._grow_chain(g, q, sampling, generator)
                elif mode == "static":
                    self._grow_static(g, q, shape, sampling, generator)
                else:
                    self._grow_dyntree(g, q, sampling, generator)
                if g.depth >= g.max_depth or g.drafted >= g.max_nodes and (sampling or mode != "dyntree"):
                    g.frontier = []
        return [self._finish(g, sampling, vocab, mode) for g in growths]

    def observe(self, tree: DraftTree, accepted_nodes: Sequence[int]) -> int:
        """Feed one verification outcome to the calibrator; returns how many nodes were judged."""
        return self.calibrator.observe(tree, accepted_nodes)

    # -- growth rules ---------------------------------------------------------------------------
    def _shape(self, mode: TreeMode) -> tuple[tuple[int, ...], ...]:
        if mode == "static":
            return self.options.static_shape or MEDUSA_63
        return ()

    def _values(self, g: _Growth, nodes: list[int], conf: torch.Tensor, ents: torch.Tensor) -> torch.Tensor:
        """``[F, k]`` path values of children with confidences ``conf`` (``[F, k]``) under
        ``nodes`` (``F`` parents whose draft entropies are ``ents``), at depth ``g.depth``."""
        conf = conf.float().cpu()
        depth = torch.full(conf.shape, g.depth, dtype=torch.int64)
        cal = self.calibrator.predict(depth, conf, ents.float().cpu().reshape(-1, 1).expand(conf.shape))
        return torch.tensor([g.values[i] for i in nodes]).reshape(-1, 1) * cal

    def _grow_chain(self, g: _Growth, q: torch.Tensor, sampling: bool, gen: torch.Generator | None) -> None:
        node, row = g.frontier[0], q[0]
        g.frontier = []
        if not bool((row > 0).any()):
            return
        if sampling:
            tok = draw_children(q[:1], [1], self.options.sampling_scheme, gen)[0][0]
        else:
            tok = int(row.argmax())
        ent = entropy(row[None])
        value = float(self._values(g, [node], row[tok].reshape(1, 1), ent)[0, 0])
        g.frontier = [g.add(node, tok, float(row[tok]), float(ent[0]), value)]

    def _grow_static(
        self, g: _Growth, q: torch.Tensor, shape: tuple[tuple[int, ...], ...], sampling: bool, gen: torch.Generator | None
    ) -> None:
        allowed = [p for p in shape if len(p) <= g.max_depth][: g.max_nodes]
        allowed_set = set(allowed)
        ents = entropy(q)
        support = (q > 0).sum(-1).tolist()
        child_ranks = []
        for node, n_support in zip(g.frontier, support):
            base = g.shape_path[node]
            ranks = sorted(p[-1] for p in allowed_set if len(p) == len(base) + 1 and p[:-1] == base)
            child_ranks.append(ranks[:n_support] if sampling else ranks)
        if sampling:
            drawn = draw_children(q, [len(r) for r in child_ranks], self.options.sampling_scheme, gen)
        else:
            k = min(max((r[-1] + 1 for r in child_ranks if r), default=0), q.shape[1])
            top = torch.topk(q, k, dim=-1).indices.tolist() if k else [[] for _ in g.frontier]
            drawn = [[top[f][r] for r in ranks if r < k and float(q[f, top[f][r]]) > 0] for f, ranks in enumerate(child_ranks)]
            child_ranks = [ranks[: len(d)] for ranks, d in zip(child_ranks, drawn)]
        new = []
        for f, (node, ranks, toks) in enumerate(zip(g.frontier, child_ranks, drawn)):
            if not toks:
                continue
            conf = q[f, toks].float()
            vals = self._values(g, [node], conf[None], ents[f])[0]
            for r, tok, c, v in zip(ranks, toks, conf.tolist(), vals.tolist()):
                path = g.shape_path[node] + (r,)
                child = g.add(node, tok, c, float(ents[f]), v, path)
                if any(len(p) == len(path) + 1 and p[:-1] == path for p in allowed_set):
                    new.append(child)
        g.frontier = new

    def _max_children(self, ents: torch.Tensor) -> torch.Tensor:
        o = self.options
        if o.entropy_high <= o.entropy_low:
            frac = (ents > o.entropy_low).float()
        else:
            frac = ((ents - o.entropy_low) / (o.entropy_high - o.entropy_low)).clamp(0, 1)
        return 1 + torch.round(frac * (o.max_children - 1)).long()

    def _grow_dyntree(self, g: _Growth, q: torch.Tensor, sampling: bool, gen: torch.Generator | None) -> None:
        o = self.options
        ents = entropy(q).cpu()
        k = self._max_children(ents)
        if sampling:  # draws without replacement need that many tokens with mass; greedy: top_p > 0 below
            k = torch.minimum(k, (q > 0).sum(-1).cpu())
        kmax = min(int(k.max()) if k.numel() else 0, q.shape[1])
        if kmax == 0:
            g.frontier = []
            return
        top_p, top_i = torch.topk(q.float(), kmax, dim=-1)
        top_p, top_i = top_p.cpu(), top_i.cpu()
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
            drawn = draw_children(q, counts.tolist(), o.sampling_scheme, gen)
            for f, (node, toks) in enumerate(zip(g.frontier, drawn)):
                if not toks:
                    continue
                conf = q[f, toks].float()
                child_vals = self._values(g, [node], conf[None], ents[f])[0]
                for tok, c, v in zip(toks, conf.tolist(), child_vals.tolist()):
                    new.append((v, g.add(node, tok, c, float(ents[f]), v)))
        else:  # greedy children are the chosen candidates themselves: their values are known
            p_list, i_list, v_list, e_list = top_p.tolist(), top_i.tolist(), vals.tolist(), ents.tolist()
            for c in chosen:  # sorted: parents in frontier order, each one's children in rank order
                f, j = divmod(c, kmax)
                new.append((v_list[f][j], g.add(g.frontier[f], i_list[f][j], p_list[f][j], e_list[f], v_list[f][j])))
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
        remap = {old: new for new, old in enumerate(keep)}
        parents = [-1] + [remap[g.parents[i]] for i in keep[1:]]
        dists = None
        if sampling and vocab is not None:
            dev = next(iter(g.dists.values())).device if g.dists else torch.device("cpu")
            dists = torch.zeros(len(keep), vocab, device=dev)
            for old, row in g.dists.items():
                if old in remap:
                    dists[remap[old]] = row.float()
        return BuiltTree(
            torch.tensor([g.tokens[i] for i in keep], dtype=torch.int64),
            torch.tensor(parents, dtype=torch.int64),
            torch.tensor([g.probs[i] for i in keep], dtype=torch.float32).clamp(0, 1),
            dists,
            node_entropy=torch.tensor([g.ents[i] for i in keep], dtype=torch.float32),
            values=torch.tensor([g.values[i] for i in keep], dtype=torch.float32),
        )
