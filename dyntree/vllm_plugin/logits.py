"""Greedy steps' logits through the LM head's fp16 screen (:mod:`dyntree.kernels.screened_head`).

:func:`install_screen` wraps the runner's model's ``compute_logits`` once (from the proposer's
``bind``) where the head can be screened: ``screened_head`` on, an fp32 head on a CPU with
FBGEMM's fp16 GEMM, logits neither soft-capped nor scaled, no bias, one tensor-parallel rank. A
step of at most :data:`SCREEN_MAX_ROWS` logits rows whose requests all decode greedily with
nothing that reads or changes the logits (every request has speculator params, all greedy:
:func:`~dyntree.vllm_plugin.proposer.speculator_params` turns away penalties, logit bias, logprobs,
structured output, ...) then gets logits whose argmax is the head's in every row (the settled rows
``-inf`` but ``0`` at the winner); any other step, the head's own logits. The step is the
proposer's (:attr:`~dyntree.vllm_plugin.proposer.DynTreeProposer.step`, opened before the forward).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

import torch

from dyntree.kernels.screened_head import ScreenedHead

if TYPE_CHECKING:
    from dyntree.vllm_plugin.proposer import DynTreeProposer

__all__ = ["SCREEN_MAX_ROWS", "install_screen", "screenable"]

#: The most logits rows a step's screen runs over: past them the fp16 GEMM gains nothing on the
#: 2-core AVX2 EPYC (SmolLM2's head, one thread: 4.7-10.6 ms against vLLM's 9.2-14.9 at 1-8
#: rows, 18.4 against 21.0 at 16, 37.5 against 32.0 at 32; docs/measurements.md).
SCREEN_MAX_ROWS = 16

_LOG = logging.getLogger("vllm.dyntree")  # vLLM's handler prints it as its own


def screenable(model: Any) -> torch.Tensor | None:
    """The head weight ``[vocab, d]`` of a vLLM model whose logits are ``h W^T`` and nothing else
    (no soft cap, scale, bias or tensor-parallel gather), else ``None``."""
    processor, head = getattr(model, "logits_processor", None), getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if processor is None or not isinstance(weight, torch.Tensor) or getattr(processor, "logits_as_input", True):
        return None
    if processor.soft_cap is not None or processor.scale != 1.0 or getattr(head, "bias", None) is not None \
            or getattr(head, "tp_size", 1) != 1 or getattr(processor, "head_dtype", None) not in (None, weight.dtype):
        return None
    return weight[: processor.org_vocab_size]


def install_screen(model: Any, proposer: "DynTreeProposer") -> bool:
    """Wrap ``model.compute_logits`` with the screen where it applies (see the module docstring);
    whether it did."""
    weight = screenable(model)
    screen = ScreenedHead.build(weight) if weight is not None else None
    if screen is None:
        return False
    model.compute_logits = _screened(model.compute_logits, screen, proposer)
    _LOG.info("dyntree: greedy steps read an fp16 screen of the LM head (exact argmax; the fp32 head where it "
              "cannot settle a row)")
    return True


def _screened(head: Callable[[torch.Tensor], torch.Tensor], screen: ScreenedHead,
              proposer: "DynTreeProposer") -> Callable[[torch.Tensor], torch.Tensor]:
    def compute_logits(hidden_states: torch.Tensor) -> torch.Tensor:
        step = proposer.step
        if step is None or hidden_states.shape[0] > SCREEN_MAX_ROWS or hidden_states.dtype != torch.float32 \
                or not all(p is not None and p.greedy for p in step.params.values()):
            return head(hidden_states)
        return screen.logits(hidden_states, head)

    return compute_logits
