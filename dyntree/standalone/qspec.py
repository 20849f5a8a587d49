"""Quantized self-draft (QSpec-style): the loaded target drafts for itself in low precision.

The draft is built in memory from the target (no second checkpoint):

* every kept decoder layer is a *shallow copy* of the target's layer whose ``nn.Linear`` modules
  are replaced by :class:`~dyntree.common.quant.QuantLinear` (int4/int8 weights, optionally
  fake-quantized activations); norms, rotary embedding, token embeddings and the LM head are the
  target's own modules, shared (the LM head stays unquantized);
* ``skip=N`` drops the last ``N`` decoder layers (early exit; the final norm and LM head follow
  the last kept layer);
* the draft forward is the target's own decoder ``forward`` run on a shallow copy of the decoder
  whose layer list is the draft's, so with quantization off (``qspec:none``) the draft computes
  exactly what the target computes.

KV: the draft reads the target's committed prefix KV (the engine's cache, read-only, never
copied as a whole) and keeps its own draft tokens' KV in a scratch cache that lives for one
speculative step; the target's verify pass writes the real KV afterwards. The HF attention needs
one contiguous key tensor per layer, so each draft layer call concatenates that layer's prefix
with the scratch for the duration of the call (a transient copy of one layer's prefix, never a
second full cache).

Two ways to draft, both one batched draft forward per depth over every request's frontier (tree
attention mask: a node sees its request's prefix, its ancestors' scratch KV and itself):

* :meth:`QSpecDrafter.propose` (``SpecConfig.tree`` unset): top-``topk`` children per frontier
  node, the ``width`` best by cumulative draft log-probability kept per depth, until
  ``max_nodes`` or ``max_depth``. Deterministic, so verification stays lossless in greedy and in
  sampling mode (point-mass proposals).
* :meth:`QSpecDrafter.expand_batch` (``SpecConfig.tree`` = ``chain`` / ``static`` /
  ``dyntree``): the engine's tree builder picks the children and calls once per depth; the
  draft returns its log-probabilities after every frontier node (sampled trees then carry the
  draft distributions). The scratch KV lives from a call holding only roots (a new step) until
  the last possible depth, the verify outcome (:meth:`~QSpecDrafter.observe`) or the next step.

Torch only (the target is any HF Llama-style causal LM; transformers is not imported here).
Importing this module registers the ``qspec`` drafter.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Hashable, Protocol, Sequence

import torch
from torch import nn

from dyntree.common.drafter import DraftRequest, Drafter, register_drafter
from dyntree.common.quant import QSpec, QSpecError, QuantLinear, parse_qspec
from dyntree.common.tree import DraftTree

if TYPE_CHECKING:
    from dyntree.common.builder import PartialTree

__all__ = ["QSpecDrafter", "build_draft_layers", "make_qspec_drafter"]


def _quantized_copy(module: nn.Module, spec: QSpec) -> nn.Module:
    """``module`` with every ``nn.Linear`` inside replaced by a ``QuantLinear``; submodules
    without linear layers (norms, rotary) are the original objects, not copies."""
    if isinstance(module, nn.Linear):
        return QuantLinear.from_linear(module, spec)
    if not any(isinstance(m, nn.Linear) for m in module.modules()):
        return module
    clone = copy.copy(module)  # shares parameters and buffers; gets its own child table
    clone._modules = {name: _quantized_copy(child, spec) for name, child in module._modules.items()}
    return clone


def build_draft_layers(layers: Sequence[nn.Module], spec: QSpec) -> nn.ModuleList:
    """The draft's decoder layers: the first ``len(layers) - skip`` target layers, quantized
    copies (or the very same modules when ``spec`` does not quantize)."""
    n = len(layers)
    if spec.skip_layers >= n:
        raise QSpecError(f"qspec: skip={spec.skip_layers} must leave at least one of the target's {n} layers")
    kept = list(layers)[: n - spec.skip_layers]
    return nn.ModuleList([_quantized_copy(layer, spec) if spec.quantized else layer for layer in kept])


class _ScratchKV:
    """The cache object the draft forward writes to: per layer, the target's prefix KV (views,
    read-only, set for the duration of one forward) followed by this step's draft tokens' KV
    (scratch, owned)."""

    def __init__(self, n_layers: int) -> None:
        self.prefix: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_layers
        self.scratch: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_layers
        self.peak_transient_bytes = 0

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        old = self.scratch[layer_idx]
        self.scratch[layer_idx] = (key, value) if old is None else (torch.cat([old[0], key], 2), torch.cat([old[1], value], 2))
        k, v = self.scratch[layer_idx]
        pre = self.prefix[layer_idx]
        if pre is None:
            return k, v
        full_k, full_v = torch.cat([pre[0], k], 2), torch.cat([pre[1], v], 2)
        self.peak_transient_bytes = max(self.peak_transient_bytes, 2 * full_k.numel() * full_k.element_size())
        return full_k, full_v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        pre, scr = self.prefix[layer_idx], self.scratch[layer_idx]
        return (0 if pre is None else pre[0].shape[2]) + (0 if scr is None else scr[0].shape[2])

    @property
    def scratch_bytes(self) -> int:
        return sum(2 * s[0].numel() * s[0].element_size() for s in self.scratch if s is not None)


class _Tree(Protocol):
    """What a draft forward reads of a tree under construction (``_Builder`` or the engine
    builder's ``PartialTree``)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]


def _ancestors(tree: _Tree, node: int) -> list[int]:
    out = []
    while tree.parents[node] >= 0:
        node = tree.parents[node]
        out.append(node)
    return out


class _Step:
    """One speculative step's draft state for a batch of requests: the scratch KV of every node
    forwarded so far and the scratch slot each node's KV sits in."""

    def __init__(self, requests: Sequence[DraftRequest], n_layers: int) -> None:
        self.requests = list(requests)
        self.ids: list[Hashable] = [r.request_id for r in requests]
        self.kv = _ScratchKV(n_layers)
        self.prefix_len = max(r.kv_len for r in requests)
        self.kv_lens = torch.tensor([r.kv_len for r in requests])
        self.slots = 0  # scratch slots used (every forward adds ``width`` slots, padding included)
        self.slot: list[dict[int, int]] = [{} for _ in requests]  # per request: node -> slot

    def inputs(self, frontiers: Sequence[Sequence[int]], trees: Sequence[_Tree]) -> tuple[torch.Tensor, ...]:
        """Tokens, positions and the boolean attention pattern ``[B, width, prefix + slots +
        width]`` of the next draft forward: each node sees its request's committed prefix, the
        scratch slots of its ancestors and itself; padding sees only itself."""
        b, width = len(self.requests), max(len(f) for f in frontiers)
        tokens = torch.zeros(b, width, dtype=torch.int64)
        positions = self.kv_lens[:, None].repeat(1, width)
        allowed = torch.zeros(b, width, self.prefix_len + self.slots + width, dtype=torch.bool)
        allowed[:, :, self.prefix_len + self.slots :] = torch.eye(width, dtype=torch.bool)
        for r, (req, nodes, tree) in enumerate(zip(self.requests, frontiers, trees)):
            tokens[r] = req.root
            allowed[r, : len(nodes), : req.kv_len] = True
            for j, node in enumerate(nodes):
                if not 0 <= node < len(tree.tokens) or node in self.slot[r]:
                    raise ValueError(f"qspec: request {req.request_id!r}: frontier node {node} is not a new node "
                                     f"of its tree ({len(tree.tokens)} nodes, {len(self.slot[r])} forwarded)")
                tokens[r, j] = tree.tokens[node]
                positions[r, j] += tree.depths[node]
                for a in _ancestors(tree, node):
                    if a not in self.slot[r]:
                        raise ValueError(f"qspec: request {req.request_id!r}: frontier node {node}'s ancestor "
                                         f"{a} was never a frontier node of this step (no draft KV)")
                    allowed[r, j, self.prefix_len + self.slot[r][a]] = True
        return tokens, positions, allowed

    def commit(self, frontiers: Sequence[Sequence[int]]) -> None:
        """Record the scratch slots the last forward wrote for ``frontiers``."""
        for r, nodes in enumerate(frontiers):
            for j, node in enumerate(nodes):
                self.slot[r][node] = self.slots + j
        self.slots += max(len(f) for f in frontiers)


class _Builder:
    """One request's growing tree for :meth:`QSpecDrafter.propose`."""

    def __init__(self, req: DraftRequest) -> None:
        self.req = req
        self.tokens = [req.root]
        self.parents = [-1]
        self.probs = [1.0]
        self.depths = [0]
        self.logp = [0.0]  # cumulative draft log-probability of each node's path

    def expand(self, frontier: list[int], top_logp: torch.Tensor, top_ids: torch.Tensor, width: int) -> list[int]:
        """Add the ``width`` best children (by path log-prob) of the forwarded ``frontier``;
        returns the new nodes that still need a forward (their children fit the limits)."""
        room = self.req.max_nodes - (len(self.tokens) - 1)
        depth = self.depths[frontier[0]] + 1
        if room <= 0 or depth > self.req.max_depth:
            return []
        scores = torch.tensor([self.logp[f] for f in frontier])[:, None] + top_logp.double()
        order = torch.argsort(scores.flatten(), descending=True)[: min(width, room)]
        k = top_ids.shape[1]
        new = []
        for flat in order.tolist():
            f, j = frontier[flat // k], flat % k
            self.tokens.append(int(top_ids[flat // k, j]))
            self.parents.append(f)
            self.probs.append(float(top_logp[flat // k, j].exp()))
            self.depths.append(depth)
            self.logp.append(float(scores.flatten()[flat]))
            new.append(len(self.tokens) - 1)
        room -= len(new)
        return new if room > 0 and depth < self.req.max_depth else []

    def tree(self) -> DraftTree:
        return DraftTree(
            torch.tensor(self.tokens, dtype=torch.int64),
            torch.tensor(self.parents, dtype=torch.int64),
            torch.tensor(self.probs, dtype=torch.float32).clamp(0.0, 1.0),
        )


class QSpecDrafter(Drafter):
    """Self-draft from the target's own (quantized) weights; see the module docstring.

    Args:
        model: the loaded HF causal LM (``get_decoder()`` with a ``layers`` list,
            ``get_output_embeddings()``), the same object the engine verifies with.
        spec: what to quantize (:func:`~dyntree.common.quant.parse_qspec`).
        topk: children considered per frontier node (:meth:`propose` only).
        width: most nodes kept per depth (:meth:`propose` only).
        materialize: keep dequantized dense copies of the quantized weights (CPU acceptance
            measurements only: same numbers, faster, but the memory saving is gone).
    """

    name = "qspec"
    needs_target_kv = True
    drafts_with_builder = True

    def __init__(
        self, model: nn.Module, spec: QSpec, topk: int = 4, width: int = 4, materialize: bool = False
    ) -> None:
        if topk < 1 or width < 1:
            raise ValueError(f"qspec: topk and width must be >= 1, got topk={topk}, width={width}")
        decoder = model.get_decoder()
        layers = getattr(decoder, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise QSpecError(f"qspec: the target's decoder ({type(decoder).__name__}) has no .layers ModuleList")
        self.spec, self.topk, self.width = spec, topk, width
        self.lm_head = model.get_output_embeddings()
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.n_target_layers = len(layers)
        draft_layers = build_draft_layers(layers, spec)
        self.decoder = copy.copy(decoder)  # the target's forward code over the draft's layers
        self.decoder._modules = dict(decoder._modules)
        self.decoder.layers = draft_layers
        self.decoder.config = copy.copy(decoder.config)
        self.decoder.config.num_hidden_layers = len(draft_layers)
        self.quant_layers = [m for m in draft_layers.modules() if isinstance(m, QuantLinear)]
        if materialize:
            for m in self.quant_layers:
                m.materialize(self.dtype)
        self.target_bytes = _param_bytes(model)
        self.last_scratch_bytes = 0
        self.last_transient_bytes = 0
        self._step: _Step | None = None  # the expand_batch step in progress

    @property
    def overhead_bytes(self) -> int:
        """Memory the draft adds to the target: its quantized weights (0 for ``none``)."""
        return sum(m.nbytes for m in self.quant_layers)

    def propose(self, requests: Sequence[DraftRequest], target_kv: Any = None) -> list[DraftTree]:
        if not requests:
            return []
        self._check(requests, target_kv)
        builders = [_Builder(r) for r in requests]
        frontier = [[0] if r.max_nodes > 0 and r.max_depth > 0 else [] for r in requests]
        if not any(frontier):
            return [b.tree() for b in builders]
        step = _Step(requests, len(self.decoder.layers))
        while any(frontier):
            logp = self._forward(step, frontier, builders, target_kv)
            top_logp, top_ids = logp.topk(self.topk, dim=-1)
            top_logp, top_ids = top_logp.cpu(), top_ids.cpu()
            for b, (builder, nodes) in enumerate(zip(builders, frontier)):
                frontier[b] = builder.expand(nodes, top_logp[b, : len(nodes)], top_ids[b, : len(nodes)], self.width) if nodes else []
        return [b.tree() for b in builders]

    def expand_batch(
        self,
        requests: Sequence[DraftRequest],
        frontiers: Sequence[Sequence[int]],
        partials: Sequence["PartialTree"],
        vocab_size: int,
        target_kv: Any = None,
    ) -> list[torch.Tensor]:
        """Draft log-probabilities ``[len(frontiers[b]), vocab_size]`` (on the CPU) of the token
        after each frontier node, from one batched draft forward over all requests' frontiers.

        A call whose partial trees hold only their roots starts a new step (fresh scratch KV);
        later calls of the step must pass the same requests, in order, and frontier nodes whose
        ancestors were frontier nodes of earlier calls (the builder's depth-by-depth growth).
        """
        if not len(requests) == len(frontiers) == len(partials):
            raise ValueError(
                f"expand_batch got {len(requests)} requests, {len(frontiers)} frontiers, {len(partials)} partial trees"
            )
        if vocab_size != self.lm_head.out_features:
            raise ValueError(f"expand_batch vocab_size={vocab_size}; the target's LM head has {self.lm_head.out_features}")
        if not requests:
            return []
        if all(len(p.tokens) == 1 for p in partials):
            self._check(requests, target_kv)
            self._step = _Step(requests, len(self.decoder.layers))
        elif self._step is None or self._step.ids != [r.request_id for r in requests]:
            raise ValueError("qspec expand_batch: partial trees beyond their roots, but no step was started for "
                             "these requests (a step's first call passes trees holding only their roots)")
        step = self._step
        if not any(frontiers):
            return [torch.zeros(0, vocab_size) for _ in frontiers]
        logp = self._forward(step, frontiers, partials, target_kv).cpu()
        if all(not f or p.depths[f[0]] + 1 >= r.max_depth for r, f, p in zip(requests, frontiers, partials)):
            self._step = None  # no node can be deeper: nothing will attend to this scratch again
        return [logp[b, : len(f)] for b, f in enumerate(frontiers)]

    def observe(self, request_id: Hashable, token_ids: Sequence[int], accepted_depth: int) -> None:
        """The step was verified: drop its scratch KV."""
        self._step = None

    def release(self, request_id: Hashable) -> None:
        self._step = None

    def _check(self, requests: Sequence[DraftRequest], target_kv: Any) -> None:
        if target_kv is None:
            raise ValueError("qspec drafter reads the target's KV cache: the engine must pass target_kv")
        for r in requests:
            if r.kv_len != len(r.token_ids) - 1:
                raise ValueError(f"qspec: request {r.request_id!r} has kv_len={r.kv_len}, expected len(token_ids)-1")

    def _forward(
        self, step: _Step, frontiers: Sequence[Sequence[int]], trees: Sequence[_Tree], target_kv: Any
    ) -> torch.Tensor:
        """One batched draft forward over ``frontiers``: log-probabilities ``[B, width, V]``
        (fp32, on the model's device; padding rows are garbage). The target's prefix KV is
        attached for this forward only; the frontier's KV stays in the step's scratch."""
        tokens, positions, allowed = step.inputs(frontiers, trees)
        mask = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(~allowed, torch.finfo(self.dtype).min)
        step.kv.prefix = self._prefix(target_kv, step.requests)
        try:
            with torch.inference_mode():
                hidden = self.decoder(
                    input_ids=tokens.to(self.device),
                    position_ids=positions.to(self.device),
                    attention_mask=mask[:, None].to(self.device),
                    past_key_values=step.kv,
                    use_cache=True,
                ).last_hidden_state
                logp = torch.log_softmax(self.lm_head(hidden).float(), dim=-1)
        finally:
            step.kv.prefix = [None] * len(step.kv.prefix)
        step.commit(frontiers)
        self.last_scratch_bytes = step.kv.scratch_bytes
        self.last_transient_bytes = step.kv.peak_transient_bytes
        return logp

    def _prefix(self, target_kv: Any, requests: Sequence[DraftRequest]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per draft layer, the target's keys/values for the requests' rows, sliced to the
        longest prefix (views when the requests are the cache's rows in order)."""
        prefix_len = max(r.kv_len for r in requests)
        rows = [r.row for r in requests]
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        layers = getattr(target_kv, "layers", [])
        for i in range(len(self.decoder.layers)):
            layer = layers[i] if i < len(layers) else None
            keys = getattr(layer, "keys", None)
            if prefix_len == 0 or keys is None or keys.numel() == 0:
                out.append(None)
                continue
            if keys.shape[2] < prefix_len:
                raise ValueError(f"qspec: target KV layer {i} holds {keys.shape[2]} slots, requests need {prefix_len}")
            values = layer.values
            if rows != list(range(keys.shape[0])):
                idx = torch.tensor(rows, device=keys.device)
                keys, values = keys.index_select(0, idx), values.index_select(0, idx)
            out.append((keys[:, :, :prefix_len], values[:, :, :prefix_len]))
        return out


def _param_bytes(model: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for p in model.parameters():  # tied weights appear once
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


@register_drafter("qspec", check=parse_qspec)
def make_qspec_drafter(options: str | None = None, *, model: nn.Module | None = None, **_: Any) -> QSpecDrafter:
    """Factory for ``--drafter qspec[:options]``; needs the loaded target as ``model``."""
    spec = parse_qspec(options)
    if model is None:
        raise ValueError("qspec drafter needs the loaded target model (make_drafter(..., model=model))")
    return QSpecDrafter(model, spec)
