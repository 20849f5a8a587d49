"""The worker side of the vLLM adapter: :class:`DynTreeProposer`, vLLM's ``custom_class`` drafter.

vLLM builds it in each worker (``Class(vllm_config)``), hands it the target model
(``load_model``) and calls ``propose`` after every step with the tokens sampled per request. It
owns the worker's :class:`~dyntree.common.speculator.Speculator` and translates: request ids and
committed tokens in, each tree's draft nodes (root excluded, in the tree's order) out, to be
scheduled as vLLM's draft tokens. The runner hooks in :mod:`dyntree.vllm_plugin.runner` bind it to
the model runner once (:meth:`~DynTreeProposer.bind`), open each step with its
:class:`~dyntree.vllm_plugin.runner.StepRecord` (:meth:`~DynTreeProposer.begin_step`: request ids
and sampling in batch order, the step's trees) and read its trees back to verify them.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Hashable

import numpy as np
import torch

from dyntree.common.config import SamplingParams, SpecConfig
from dyntree.common.cost_model import CostModel, knot_sizes
from dyntree.common.drafter import TargetInfo
from dyntree.common.drafters import make_engine_drafter
from dyntree.common.speculator import SpecRequest, Speculator
from dyntree.common.tree import DraftTree
from dyntree.vllm_plugin.logits import install_screen
from dyntree.vllm_plugin.options import ENV
from dyntree.vllm_plugin.step import StepRecord

__all__ = ["DynTreeProposer", "speculator_params"]


class DynTreeProposer:
    """Drafts trees for vLLM's V1 runner through the speculator (see the module docstring)."""

    def __init__(self, vllm_config: Any) -> None:
        raw = os.environ.get(ENV)
        if raw is None:
            raise RuntimeError(f"dyntree proposer built without {ENV}: use speculative_config={{'method': 'dyntree'}}")
        self.spec = spec = SpecConfig.model_validate_json(raw)
        self.vllm_config = vllm_config
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.speculator: Speculator | None = None
        self.drafter_spec = spec.drafter
        self.generator = torch.Generator().manual_seed(0)
        self.trees: dict[Hashable, DraftTree] = {}  # the last propose call's trees, by request id
        self.runner: Any = None  # the model runner (bind)
        self.step: StepRecord | None = None  # the step in flight (begin_step)
        self._admitted: dict[str, tuple[SamplingParams | None, int]] = {}  # per live request (admit)

    # -- vLLM's custom_class contract -------------------------------------------------------------
    def load_model(self, target_model: torch.nn.Module) -> None:
        """Build the drafter over the loaded target (Hydra borrows its embeddings and LM head; the
        quantized self-draft quantizes a copy of its linears)."""
        model_config = self.vllm_config.model_config
        vocab = int(model_config.get_vocab_size())
        drafter, self.drafter_spec = make_engine_drafter(
            self.drafter_spec, lambda: _target_info(target_model, self.vllm_config, vocab))
        if drafter.needs_self_draft:  # qspec: the target's own layers, quantized, over vLLM's paged KV
            from dyntree.vllm_plugin.selfdraft import VllmSelfDraft

            drafter.attach(VllmSelfDraft(target_model, self, getattr(drafter, "spec"), vocab))
        self.speculator = Speculator(drafter, self.spec.model_copy(update={"drafter": self.drafter_spec}), vocab_size=vocab,
                                     cost_model=self._measure_cost if self.spec.adaptive else None)

    def bind(self, runner: Any) -> None:
        """The model runner this proposer drafts for (its KV caches, block tables and dummy
        forwards); the first call also sets up the adaptive controller, timing vLLM's forwards now
        that the KV cache exists, and the LM head's screen for greedy steps
        (:func:`~dyntree.vllm_plugin.logits.install_screen`)."""
        if self.runner is runner:
            return
        self.runner = runner
        assert self.speculator is not None
        self.speculator.prepare()
        if self.spec.screened_head:
            install_screen(runner.model, self)

    def begin_step(self, step: StepRecord) -> None:
        """The step vLLM is about to run: its batch (the next :meth:`propose` call's rows) and trees."""
        self.step = step

    def admit(self, request_id: str, state: Any) -> tuple[SamplingParams | None, int]:
        """From vLLM's request ``state`` (the runner's ``CachedRequestState``): its sampling as the
        speculator's (:func:`speculator_params`) and the most tokens, prompt included, it may reach
        (``max_tokens`` after the prompt, within the model's length); read once per request, as
        neither changes while it runs."""
        if request_id not in self._admitted:
            sp = state.sampling_params
            most = sp.max_tokens if sp is not None and sp.max_tokens is not None else self.max_model_len
            self._admitted[request_id] = (speculator_params(sp),
                                          min(int(state.num_prompt_tokens) + int(most), self.max_model_len))
        return self._admitted[request_id]

    def release(self, request_id: str) -> None:
        """The request ended, or is recomputed from the start: drop its state."""
        self._admitted.pop(request_id, None)
        assert self.speculator is not None
        self.speculator.release(request_id)

    def _measure_cost(self) -> CostModel:
        """The adaptive controller's starting cost model: vLLM's own dummy forwards (attention
        included) of every size of one request's verify (1 to 16 query tokens: vLLM's CPU forward
        costs more at 2 than at 3-5), then 32, 64, ..., timed once the KV cache exists (first step).
        The sizes up to 16 keep their fastest of seven rounds, the larger ones of two: the knots up
        to 6 tokens lie within a few percent of each other, and the shape the start-up read is the
        one the online model keeps for the sizes it seldom sees (:meth:`CostModel.observe`), so two
        rounds' noise could price a 4-token verify above a plain step for a whole run."""
        runner = self.runner
        if runner is None:
            raise RuntimeError("dyntree: the adaptive controller needs the model runner; the runner patch did not run")
        limit = min(int(runner.max_num_tokens), self.spec.controller.max_batch_tokens,
                    int(self.vllm_config.scheduler_config.max_num_seqs) * (1 + self.spec.max_nodes))
        sizes = knot_sizes(min(limit, 512))
        def forward(n: int) -> None:
            runner._dummy_run(n, force_attention=True)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)  # time the forward, not its launch

        return CostModel.measure(forward, sizes, repeats=7, lr=self.spec.controller.cost_lr, large_repeats=2)

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None, **_: Any) -> list[list[int]]:
        """One draft list per request in batch order: its tree's nodes after the root (``[]``: none)."""
        assert self.speculator is not None and self.step is not None
        self.trees = {}
        live = []  # (batch row, request id, committed tokens) of the requests that may draft
        req_ids, all_params = self.step.req_ids, self.step.params
        for i, sampled in enumerate(sampled_token_ids):
            rid = req_ids[i] if i < len(req_ids) else None
            n = int(num_tokens_no_spec[i])
            if sampled and rid is not None and all_params.get(rid) is not None and n + 1 < self.max_model_len:
                live.append((i, rid, n))
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        limits = self.step.limits
        # built once, and on a quiet step only if the drafter is asked what it knows
        requests = functools.cache(lambda: [SpecRequest(rid, token_ids_cpu[i, :n].tolist(), all_params[rid],
                                                        max_nodes=self.max_model_len - n - 1, remaining=limits[rid] - n)
                                            for i, rid, n in live])
        if not live or self.speculator.quiet([rid for _, rid, _ in live], requests):  # quiet: plain decoding
            return out
        batch = self.speculator.propose(requests(), self.generator, self.step.waiting)
        for (i, rid, _), tree in zip(live, batch.trees):
            self.trees[rid] = tree
            out[i] = tree.tokens[1:].tolist()
        return out


def _target_info(model: torch.nn.Module, vllm_config: Any, vocab: int) -> TargetInfo:
    """What Hydra borrows from vLLM's loaded model (weights shared, cut to the real vocabulary)."""
    from transformers import AutoTokenizer

    from dyntree.kernels.cpu_weight_only import cpu_weight_kernel

    mc = vllm_config.model_config
    tok = AutoTokenizer.from_pretrained(mc.tokenizer, trust_remote_code=mc.trust_remote_code)
    return TargetInfo.from_model(model, tok, str(mc.model), vocab,
                                 weight_kernel=cpu_weight_kernel(next(model.parameters()).device))


def speculator_params(sp: Any) -> SamplingParams | None:
    """The request's sampling as the speculator's params, or ``None`` when it must decode plainly
    (whatever the tree verifier does not reproduce: penalties, logit bias, allowed or bad words,
    min-p, min-tokens, structured output, logprobs)."""
    if sp is None:
        return None
    plain = (
        sp.presence_penalty != 0 or sp.frequency_penalty != 0 or sp.repetition_penalty != 1 or sp.min_p != 0
        or sp.min_tokens or sp.logit_bias or sp.allowed_token_ids or sp.bad_words or sp.structured_outputs
        or sp.logprobs is not None or sp.prompt_logprobs is not None
    )
    if plain:
        return None
    greedy = sp.temperature < 1e-5
    return SamplingParams(temperature=0.0 if greedy else sp.temperature, top_k=max(sp.top_k, 0),
                          top_p=sp.top_p)
