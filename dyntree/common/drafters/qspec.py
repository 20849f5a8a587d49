"""Quantized self-draft (QSpec-style): the target drafts for itself in low precision.

The engine-independent half lives here: the draft's decoder layers (:func:`build_draft_layers`:
quantized copies of the target's own layers, no second checkpoint) and :class:`QSpecDrafter`,
which grows trees through the builder and keeps one step's draft bookkeeping: which scratch KV
slot holds each forwarded node, and what every draft token may attend to (its request's
committed prefix, its ancestors' scratch slots, itself). The engine-specific half, running those
layers against the engine's own KV layout, is a :class:`~dyntree.common.drafter.SelfDraftBackend`
the engine attaches (the Hugging Face one: :mod:`dyntree.standalone.selfdraft`).

Layers: every kept decoder layer is a *shallow copy* of the target's whose ``nn.Linear`` modules
are :class:`~dyntree.common.quant.QuantLinear` (int4/int8 weights, optionally fake-quantized
activations); norms and rotary are the target's own modules; ``skip=N`` drops the last ``N``
layers (early exit). With quantization off (``qspec:none``) the layers *are* the target's, so the
draft computes exactly what the target computes.

Step: a call to :meth:`QSpecDrafter.expand` whose partial trees hold only their roots starts a
step (the backend drops its scratch); each call forwards one depth's frontier of every request in
one batched draft forward. Own trees (``SpecConfig.tree`` unset) are the builder's ``beam`` shape,
its width spread over the depths of the budget (``ceil(max_nodes / max_depth)``, ``topk`` = width),
so a chain budget drafts a chain (a fixed width filled a chain budget at depth 2:
``docs/measurements.md``).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Hashable, Sequence

import torch
from torch import nn

from dyntree.common.drafter import Candidates, DraftRequest, Drafter, SelfDraftBackend, top_candidates
from dyntree.common.quant import QSpec, QSpecError, QuantLinear, WeightKernel, parse_qspec

if TYPE_CHECKING:
    from dyntree.common.builder import PartialTree
    from dyntree.common.config import SamplingParams

__all__ = ["QSpecDrafter", "build_draft_layers", "kept_layers", "make_qspec_drafter"]

def _quantized_copy(module: nn.Module, spec: QSpec, kernel: WeightKernel | None) -> nn.Module:
    """``module`` with every ``nn.Linear`` inside replaced by a ``QuantLinear``; submodules
    without linear layers (norms, rotary) are the original objects, not copies."""
    if isinstance(module, nn.Linear):
        return QuantLinear.from_linear(module, spec, kernel=kernel)
    if not any(isinstance(m, nn.Linear) for m in module.modules()):
        return module
    clone = copy.copy(module)  # shares parameters and buffers; gets its own child table
    clone._modules = {name: _quantized_copy(child, spec, kernel) for name, child in module._modules.items()}
    return clone


def build_draft_layers(layers: Sequence[nn.Module], spec: QSpec, kernel: WeightKernel | None = None) -> nn.ModuleList:
    """The draft's decoder layers: the first ``len(layers) - skip`` target layers, quantized
    copies (or the very same modules when ``spec`` does not quantize). ``kernel`` is an optional
    device matmul for the quantized weights (see :class:`~dyntree.common.quant.QuantLinear`)."""
    kept = kept_layers(layers, spec)
    return nn.ModuleList([_quantized_copy(layer, spec, kernel) if spec.quantized else layer for layer in kept])


def kept_layers(layers: Sequence[nn.Module], spec: QSpec) -> list[nn.Module]:
    """The target layers the draft runs: all but the last ``spec.skip_layers``."""
    n = len(layers)
    if spec.skip_layers >= n:
        raise QSpecError(f"qspec: skip={spec.skip_layers} must leave at least one of the target's {n} layers")
    return list(layers)[: n - spec.skip_layers]


class _Step:
    """One speculation step's draft state: the scratch slot of every node forwarded so far."""

    def __init__(self, requests: Sequence[DraftRequest]) -> None:
        self.ids: list[Hashable] = [r.request_id for r in requests]
        self.kv_lens = torch.tensor([r.kv_len for r in requests])
        self.slots = 0  # scratch slots used (every forward adds ``width`` slots, padding included)
        self.slot: list[dict[int, int]] = [{} for _ in requests]  # per request: node -> slot

    def inputs(self, frontiers: Sequence[Sequence[int]], trees: Sequence["PartialTree"]) -> tuple[torch.Tensor, ...]:
        """Tokens, positions and the scratch mask ``[B, width, slots + width]`` of the next draft
        forward: each node sees its ancestors' scratch slots and itself; padding only itself."""
        b, width = len(self.ids), max(len(f) for f in frontiers)
        tokens = torch.zeros(b, width, dtype=torch.int64)
        positions = self.kv_lens[:, None].repeat(1, width)
        allowed = torch.zeros(b, width, self.slots + width, dtype=torch.bool)
        allowed[:, :, self.slots :] = torch.eye(width, dtype=torch.bool)
        for r, (nodes, tree) in enumerate(zip(frontiers, trees)):
            tokens[r] = tree.tokens[0]
            for j, node in enumerate(nodes):
                if not 0 <= node < len(tree.tokens) or node in self.slot[r]:
                    raise ValueError(f"qspec: request {self.ids[r]!r}: frontier node {node} is not a new node "
                                     f"of its tree ({len(tree.tokens)} nodes, {len(self.slot[r])} forwarded)")
                tokens[r, j] = tree.tokens[node]
                positions[r, j] += tree.depths[node]
                a = node
                while tree.parents[a] >= 0:
                    a = tree.parents[a]
                    if a not in self.slot[r]:
                        raise ValueError(f"qspec: request {self.ids[r]!r}: frontier node {node}'s ancestor "
                                         f"{a} was never a frontier node of this step (no draft KV)")
                    allowed[r, j, self.slot[r][a]] = True
        return tokens, positions, allowed

    def commit(self, frontiers: Sequence[Sequence[int]]) -> None:
        """Record the scratch slots the last forward wrote for ``frontiers``."""
        for r, nodes in enumerate(frontiers):
            for j, node in enumerate(nodes):
                self.slot[r][node] = self.slots + j
        self.slots += max(len(f) for f in frontiers)


def _acceptance_prior(spec: QSpec) -> float | None:
    """A starting point for the controller: the draft is the target up to weight rounding (the
    controller then learns the real value). ``None`` (the generic prior) where the spec drops
    layers or quantizes activations, whose effect is model-dependent."""
    if spec.skip_layers or spec.act_bits is not None:
        return None
    return {None: 1.0, 8: 0.9, 4: 0.75}[spec.weight_bits]


class QSpecDrafter(Drafter):
    """Self-draft from the target's own (quantized) weights through an engine's backend."""

    name = "qspec"
    needs_self_draft = True

    def __init__(self, spec: QSpec, topk: int | None = None, width: int | None = None) -> None:
        if (topk is not None and topk < 1) or (width is not None and width < 1):
            raise ValueError(f"qspec: topk and width must be >= 1, got topk={topk}, width={width}")
        self.spec = spec
        self.beam_width, self.beam_topk = width, topk
        self.acceptance_prior = _acceptance_prior(spec)
        # a level is a forward of the draft layers: int8 weights at about half a target forward
        # (~34 ms a level against ~59 ms at batch 1 inside vLLM on a 2-core Xeon, fp32), refined
        # online from the first draft on
        self.level_cost_share = 0.5 if spec.quantized else 1.0
        self.backend: SelfDraftBackend | None = None
        self._step: _Step | None = None

    def attach(self, backend: SelfDraftBackend) -> None:
        if self.backend is not None and self.backend is not backend:
            raise ValueError("this qspec drafter already drafts with another engine's forward: build one drafter per engine")
        self.backend = backend
        self._step = None

    @torch.inference_mode()
    def expand(self, requests: Sequence[DraftRequest], frontiers: Sequence[Sequence[int]],
               partials: Sequence["PartialTree"], k: int, shaping: "SamplingParams | None",
               entropy: bool = True) -> Candidates:
        """Draft candidates after every frontier node, from one batched draft forward.

        Later calls of a step must pass the same requests, in order, and frontier nodes whose
        ancestors were frontier nodes of earlier calls (the builder's depth-by-depth growth).
        """
        if self.backend is None:
            raise ValueError("qspec drafter runs the target's own layers: the engine must attach a SelfDraftBackend")
        if all(len(p.tokens) == 1 for p in partials):
            self.backend.reset(requests)
            self._step = _Step(requests)
        elif self._step is None or self._step.ids != [r.request_id for r in requests]:
            raise ValueError("qspec expand: partial trees beyond their roots, but no step was started for "
                             "these requests (a step's first call passes trees holding only their roots)")
        step = self._step
        if not any(frontiers):
            return Candidates.empty(0, k, entropy)
        tokens, positions, allowed = step.inputs(frontiers, partials)
        logits = self.backend.forward(tokens, positions, allowed)
        step.commit(frontiers)
        if all(not f or p.depths[f[0]] + 1 >= r.max_depth for r, f, p in zip(requests, frontiers, partials)):
            self._end_step()  # no node can be deeper: nothing will attend to this scratch again
        rows = torch.cat([logits[b, : len(f)] for b, f in enumerate(frontiers)])
        return top_candidates(rows, k, shaping, with_entropy=entropy)

    def observe(self, request_id: Hashable, committed: Sequence[int], accepted_drafts: int) -> None:
        """The step was verified: its scratch KV is dead."""
        self._end_step()

    def release(self, request_id: Hashable) -> None:
        self._end_step()

    def _end_step(self) -> None:
        self._step = None
        if self.backend is not None:
            self.backend.release()


def make_qspec_drafter(options: str | None = None, **_: object) -> QSpecDrafter:
    """Factory for ``--drafter qspec[:options]``; the engine attaches its forward afterwards."""
    return QSpecDrafter(parse_qspec(options))
