"""The ``hydra`` drafter: trained Hydra heads propose a draft tree, one batched head forward per depth.

Spec: ``hydra[:OPTIONS]`` where OPTIONS is a comma-separated list of a checkpoint directory
(default: the heads shipped for SmolLM2 in ``dyntree/assets/hydra-smollm2``) and ``width=W`` /
``topk=T`` settings. Tree shape (fixed, budget-bound): at depth ``d`` (``1..min(K, max_depth)``)
every frontier node is expanded with head ``d``'s top-``T`` tokens, the candidates of a request are
ranked by cumulative head probability (product along the path), and the best
``min(W, nodes left)`` become the next frontier. ``W`` defaults to ``ceil(max_nodes / depth)`` so
the node budget is spread evenly over the depths; ``T`` defaults to ``W``.

All frontier nodes of all requests go through the head in one forward per depth. With
``SpecConfig.tree`` set, the engine's tree builder shapes the tree instead and asks
:meth:`HydraDrafter.expand_batch` for the heads' distributions.

Heads with prefix attention (Hydra++) ask the engine for ``DraftRequest.new_hidden``: the drafter
keeps each request's prefix-layer KV cache, runs the layer over the new positions of all requests
in one batched forward at the first call of a step, and feeds the heads the layer's output at the
newest position instead of ``DraftRequest.hidden``; :meth:`HydraDrafter.release` drops the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Hashable, Sequence

import torch

from dyntree.common.drafter import DraftRequest, Drafter, register_drafter
from dyntree.common.hydra import HydraHeads, PrefixKV, load_heads
from dyntree.common.tree import DraftTree
from dyntree.training.target import target_identity, target_weights

if TYPE_CHECKING:
    from dyntree.common.builder import PartialTree

__all__ = ["HydraDrafter", "SHIPPED_HEADS", "make_hydra_drafter", "parse_hydra_options"]

#: The heads trained for SmolLM2-135M-Instruct that ship with the package.
SHIPPED_HEADS = Path(__file__).resolve().parents[1] / "assets" / "hydra-smollm2"


@dataclass(frozen=True)
class HydraOptions:
    path: Path = SHIPPED_HEADS
    width: int | None = None
    topk: int | None = None


def parse_hydra_options(options: str | None) -> HydraOptions:
    """Parse ``PATH``, ``width=W``, ``topk=T`` (comma separated, any order, all optional)."""
    path, ints = SHIPPED_HEADS, {}
    for item in (options or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, eq, value = item.partition("=")
        if not eq:
            path = Path(item).expanduser()
            continue
        if key not in ("width", "topk"):
            raise ValueError(f"hydra option {key!r} is unknown; use PATH, width=W, topk=T")
        try:
            ints[key] = int(value)
        except ValueError:
            raise ValueError(f"hydra option {key}={value!r} must be an integer") from None
        if ints[key] < 1:
            raise ValueError(f"hydra option {key} must be >= 1, got {ints[key]}")
    if not (path / "config.json").is_file():
        raise ValueError(f"hydra checkpoint {path} has no config.json (train one with `dyntree train-heads`)")
    return HydraOptions(path, ints.get("width"), ints.get("topk"))


@dataclass
class _Prefix:
    """One request's prefix-layer state: the cache of positions ``0 .. length - 1`` and the
    layer's output at the last of them (the heads' input)."""

    kv: PrefixKV
    last: torch.Tensor


class HydraDrafter(Drafter):
    """Drafts trees with :class:`~dyntree.common.hydra.HydraHeads` (needs the target's hidden state;
    with prefix attention, the hidden states of all committed tokens)."""

    name = "hydra"
    needs_hidden = True
    drafts_with_builder = True

    def __init__(self, heads: HydraHeads, width: int | None = None, topk: int | None = None) -> None:
        self.heads = heads.eval()
        self.width = width
        self.topk = topk
        self.device = heads.out_weight.device
        self.dtype = heads.out_weight.dtype
        self.needs_new_hidden = heads.prefix is not None
        self._prefix: dict[Hashable, _Prefix] = {}

    def release(self, request_id: Hashable) -> None:
        """Drop the request's prefix-layer cache."""
        self._prefix.pop(request_id, None)

    def _inputs(self, requests: Sequence[DraftRequest]) -> list[torch.Tensor | None]:
        """The heads' input ``[d]`` per request (``None``: nothing to draft from): the target's
        ``hidden``, or with prefix attention the prefix layer's output at position ``kv_len - 1``."""
        if self.heads.prefix is None:
            return [None if r.hidden is None else r.hidden.reshape(-1) for r in requests]
        self._advance(requests)
        return [self._prefix[r.request_id].last if r.kv_len > 0 else None for r in requests]

    def _advance(self, requests: Sequence[DraftRequest]) -> None:
        """Run the prefix layer over every request's positions not yet cached, in one batch."""
        todo = []
        for r in requests:
            state = self._prefix.get(r.request_id)
            have = state.kv.length if state is not None else 0
            if r.kv_len != have:
                todo.append((r, self._new_rows(r, have), have))
        if not todo:
            return
        width = max(rows.shape[0] for _, rows, _ in todo)
        hidden = torch.zeros(len(todo), width, self.heads.config.hidden_size, device=self.device, dtype=self.dtype)
        valid = torch.zeros(len(todo), width, dtype=torch.bool, device=self.device)
        for b, (_, rows, _) in enumerate(todo):
            hidden[b, : rows.shape[0]] = rows.to(self.device, self.dtype)
            valid[b, : rows.shape[0]] = True
        positions = torch.tensor([have for _, _, have in todo], device=self.device)[:, None] + torch.arange(
            width, device=self.device
        )
        assert self.heads.prefix is not None
        empty = self.heads.prefix.empty_kv(1, hidden)
        past = PrefixKV.stack([self._prefix[r.request_id].kv if have else empty for r, _, have in todo])
        out, kv = self.heads.prefix_forward(hidden, positions, past, valid)
        for b, (r, rows, _) in enumerate(todo):
            self._prefix[r.request_id] = _Prefix(kv.row(b), out[b, rows.shape[0] - 1].clone())

    def _new_rows(self, r: DraftRequest, have: int) -> torch.Tensor:
        """``r.new_hidden``, checked to be the rows of positions ``have .. kv_len - 1`` exactly."""
        if r.new_hidden is None:
            raise ValueError(
                f"request {r.request_id!r}: DraftRequest.new_hidden is None but the prefix layer holds "
                f"{have} of kv_len={r.kv_len} positions (engines must fill it when drafter.needs_new_hidden)"
            )
        d = self.heads.config.hidden_size
        if r.new_hidden.dim() != 2 or r.new_hidden.shape[1] != d:
            raise ValueError(f"request {r.request_id!r}: DraftRequest.new_hidden has shape "
                             f"{tuple(r.new_hidden.shape)}; expected [n_new, {d}]")
        first = r.kv_len - r.new_hidden.shape[0]
        if first != have:
            raise ValueError(
                f"request {r.request_id!r}: DraftRequest.new_hidden covers positions {first}..{r.kv_len - 1}, "
                f"but the prefix layer holds positions 0..{have - 1} (rows missing or repeated, or a "
                f"request id reused without release)"
            )
        return r.new_hidden

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest], target_kv: Any = None) -> list[DraftTree]:
        trees: list[DraftTree | None] = [None] * len(requests)
        # per active request: node tokens, parents, probs, cumulative log-prob, frontier node ids
        state: dict[int, dict[str, Any]] = {}
        inputs = self._inputs(requests)
        for i, r in enumerate(requests):
            depth = min(self.heads.num_heads, r.max_depth)
            if inputs[i] is None or r.max_nodes < 1 or depth < 1:
                trees[i] = DraftTree.root_only(r.root)
                continue
            width = self.width or math.ceil(r.max_nodes / depth)
            state[i] = {"tokens": [r.root], "parents": [-1], "probs": [1.0], "logp": [0.0], "paths": [[r.root]],
                        "frontier": [0], "depth": depth, "width": width, "topk": self.topk or width,
                        "left": r.max_nodes}
        if state:
            hidden = torch.stack([inputs[i] for i in state]).to(self.device, self.dtype)
            row_of = {i: j for j, i in enumerate(state)}
            for d in range(1, max(s["depth"] for s in state.values()) + 1):
                live = [i for i, s in state.items() if s["depth"] >= d and s["frontier"] and s["left"] > 0]
                if not live:
                    break
                owners = [(i, n) for i in live for n in state[i]["frontier"]]
                h = hidden[[row_of[i] for i, _ in owners]]
                path = torch.tensor([state[i]["paths"][n] for i, n in owners], dtype=torch.int64, device=self.device)
                probs = torch.softmax(self.heads.head_logits(d, h, path).float(), dim=-1)
                kmax = max(state[i]["topk"] for i in live)
                top_p, top_i = probs.topk(min(kmax, probs.shape[-1]), dim=-1)
                top_tok = self.heads.to_full_ids(top_i).cpu()
                top_p = top_p.cpu()
                for i in live:
                    self._extend(state[i], [(row, n) for row, (o, n) in enumerate(owners) if o == i], top_tok, top_p)
            for i, s in state.items():
                trees[i] = DraftTree(torch.tensor(s["tokens"], dtype=torch.int64),
                                     torch.tensor(s["parents"], dtype=torch.int64),
                                     torch.tensor(s["probs"], dtype=torch.float32))
        return [t for t in trees if t is not None]

    @torch.inference_mode()
    def expand_batch(
        self,
        requests: Sequence[DraftRequest],
        frontiers: Sequence[Sequence[int]],
        partials: Sequence["PartialTree"],
        vocab_size: int,
        target_kv: Any = None,
    ) -> list[torch.Tensor]:
        """Head log-probabilities ``[F, vocab_size]`` after each frontier node (tree builder modes).

        A node at depth ``d - 1`` is scored by head ``d`` (one batched forward per distinct depth
        over the whole batch); nodes deeper than the last head, and requests without a hidden
        state, get all ``-inf`` rows (no children); tokens outside a reduced vocabulary get ``-inf``.
        With prefix attention, the first call of a step advances every request's prefix layer.
        """
        if not len(requests) == len(frontiers) == len(partials):
            raise ValueError(
                f"expand_batch got {len(requests)} requests, {len(frontiers)} frontiers, {len(partials)} partial trees"
            )
        if vocab_size != self.heads.config.target.vocab_size:
            raise ValueError(f"expand_batch vocab_size={vocab_size}; the heads' vocabulary is "
                             f"{self.heads.config.target.vocab_size}")
        out = [torch.full((len(f), vocab_size), float("-inf")) for f in frontiers]
        inputs = self._inputs(requests)
        by_depth: dict[int, list[tuple[int, int, list[int]]]] = {}
        for b, (front, part) in enumerate(zip(frontiers, partials)):
            if inputs[b] is None:
                continue
            for f, node in enumerate(front):
                path = part.path_tokens(node)
                if len(path) <= self.heads.num_heads:
                    by_depth.setdefault(len(path), []).append((b, f, path))
        for k, items in by_depth.items():
            hidden = torch.stack([inputs[b] for b, _, _ in items]).to(self.device, self.dtype)
            path = torch.tensor([p for _, _, p in items], dtype=torch.int64, device=self.device)
            logp = torch.log_softmax(self.heads.head_logits(k, hidden, path).float(), dim=-1).cpu()
            cols = self.heads.to_full_ids(torch.arange(self.heads.out_vocab, device=self.device)).cpu()
            for row, (b, f, _) in enumerate(items):
                out[b][f, cols] = logp[row]
        return out

    @staticmethod
    def _extend(s: dict[str, Any], rows: list[tuple[int, int]], top_tok: torch.Tensor, top_p: torch.Tensor) -> None:
        """Add the best children of this request's frontier (by cumulative log-prob) to its tree."""
        cands = []
        for row, parent in rows:
            for j in range(s["topk"]):
                p = float(top_p[row, j])
                if p > 0.0:
                    cands.append((s["logp"][parent] + math.log(p), parent, int(top_tok[row, j]), p))
        cands.sort(key=lambda c: -c[0])
        keep = cands[: min(s["width"], s["left"])]
        frontier = []
        for logp, parent, tok, p in keep:
            s["tokens"].append(tok)
            s["parents"].append(parent)
            s["probs"].append(min(1.0, p))
            s["logp"].append(logp)
            s["paths"].append(s["paths"][parent] + [tok])
            frontier.append(len(s["tokens"]) - 1)
        s["frontier"] = frontier
        s["left"] -= len(keep)


@register_drafter("hydra", check=parse_hydra_options)
def make_hydra_drafter(options: str | None = None, *, model: Any = None, tokenizer: Any = None, **_: Any) -> HydraDrafter:
    """Factory for ``--drafter hydra[:PATH][,width=W][,topk=T]``; needs the loaded target and tokenizer."""
    opts = parse_hydra_options(options)
    if model is None or tokenizer is None:
        raise ValueError("hydra drafter needs the loaded target model and tokenizer "
                         "(make_drafter(..., model=model, tokenizer=tokenizer))")
    embed, lm_head = target_weights(model)
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    identity = target_identity(model, tokenizer, str(name))
    dtype = torch.float32 if embed.device.type == "cpu" else embed.dtype
    heads = load_heads(opts.path, identity, embed, lm_head, dtype=dtype, device=embed.device)
    return HydraDrafter(heads, opts.width, opts.topk)
