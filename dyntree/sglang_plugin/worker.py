"""The SGLang side of DYNTREE: :class:`DynTreeWorker`, a spec-v2 worker run synchronously.

SGLang's scheduler builds it with the target ``TpModelWorker`` and calls
``forward_batch_generation(batch)`` for every batch. The worker only translates between SGLang's
state and the :class:`~dyntree.common.speculator.Speculator`:

* **prefill** (extend): the target's own forward and sampling; the hidden states of the new
  prompt positions go to the speculator when the drafter reads them (Hydra);
* **decode**: ``speculator.propose`` over every request (committed tokens = prompt + outputs, the
  last one is the root; the adaptive controller plans each request's tree for this live batch),
  the trees in SGLang's verify layout (:mod:`~dyntree.sglang_plugin.layout`) as wide as this
  step's widest tree ``w`` (at most ``N``; ``w = 1`` when the controller plans no speculation),
  ONE target forward in ``TARGET_VERIFY`` mode over window ``[seq_len, seq_len + w)`` (timed: it
  refines the controller's cost model), ``speculator.accept`` on its logits (greedy or lossless
  tree sampling), the accepted nodes' KV moved to the front of the window
  (``kv_compact_sglang``: Triton on GPU, torch reference elsewhere), their hidden states pushed
  back, and a ``GenerationBatchResult`` whose row ``b`` holds the ``accept_lens[b]`` committed
  tokens (stride ``N``, as SGLang sized the reserve).

Drafters: n-gram, Hydra heads (hidden states captured from the target's forwards) and the
quantized self-draft (:class:`~dyntree.sglang_plugin.selfdraft.SglangSelfDraft`, over the token
pool). SGLang has no dummy forward to time up front, so the controller's cost model is learned
from the verify forwards themselves (:meth:`~dyntree.common.cost_model.CostModel.online`).

Requests that leave the decode batch (finished, aborted, retracted) are released from the
speculator. Requests asking for what tree verification does not apply (penalties, ``min_p``,
logit bias, grammars, logprobs) are finished at prefill with an error naming the field.
"""

from __future__ import annotations

import time
from collections import Counter
from http import HTTPStatus
from typing import Any, Hashable

import torch

from dyntree.common.cost_model import CostModel
from dyntree.common.drafter import TargetInfo
from dyntree.common.drafters import make_engine_drafter
from dyntree.common.speculator import SpecRequest, Speculator
from dyntree.kernels.dispatch import kv_compact_sglang
from dyntree.sglang_plugin.layout import commit_arrays, verify_layout
from dyntree.sglang_plugin.options import request_sampling, spec_from_server_args, unsupported_request
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.ngram_info import NgramVerifyInput

__all__ = ["DynTreeWorker", "DynTreeVerifyInput", "ABLATIONS"]

#: Test controls that each remove one piece of tree verification; outputs must then diverge.
ABLATIONS = frozenset({"mask", "positions", "compaction"})


class DynTreeVerifyInput(NgramVerifyInput):
    """NGRAM's verify input (irregular tree, ``NGRAM_VERIFY`` attention args), plus hidden-state
    capture for drafters that read the target's hidden states."""

    def __init__(self, *args: Any, capture_hidden: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.capture_hidden_mode = CaptureHiddenMode.FULL if capture_hidden else CaptureHiddenMode.NULL


class DynTreeWorker(BaseSpecWorker):
    """Tree speculation for SGLang through the speculator (see the module docstring)."""

    def __init__(self, server_args: Any, gpu_id: int, nccl_port: int, target_worker: Any) -> None:
        super().__init__()
        self.server_args = server_args
        self._target_worker = target_worker
        self.model_runner = target_worker.model_runner
        self.device = torch.device(self.model_runner.device)
        self.spec = spec_from_server_args(server_args)
        self.width = self.spec.max_nodes + 1  # N: SGLang's --speculative-num-draft-tokens
        self.speculative_num_draft_tokens = self.width
        self.mask_mode = "qlen" if self.device.type == "cpu" else "full"  # SGLang's default_tree_mask_mode
        self.ablate: frozenset[str] = frozenset()
        self.generator = torch.Generator().manual_seed(int(getattr(server_args, "random_seed", 0) or 0))
        vocab = int(self.model_runner.model_config.vocab_size)
        model = self.model_runner.model
        drafter, resolved = make_engine_drafter(self.spec.drafter, lambda: _target_info(model, server_args, vocab))
        self.batch: Any = None  # the decode batch of this step (the self-draft reads its token pool rows)
        if drafter.needs_self_draft:  # qspec: the target's own layers, quantized, over SGLang's token pool
            from dyntree.sglang_plugin.selfdraft import SglangSelfDraft

            drafter.attach(SglangSelfDraft(model, getattr(drafter, "spec"), vocab, self))
        cost = None
        if self.spec.adaptive:
            most = int(getattr(server_args, "max_running_requests", None) or 48) * self.width
            sizes = [1 << i for i in range(max(1, most - 1).bit_length() + 1)]
            cost = CostModel.online(sizes, lr=self.spec.controller.cost_lr)
        self.speculator = Speculator(drafter, self.spec.model_copy(update={"drafter": resolved}), vocab_size=vocab,
                                     cost_model=cost, padded=True)
        self._decoding: set[Hashable] = set()
        self.widths: Counter[int] = Counter()  # decode steps per verify width (what the controller chose)

    @property
    def draft_worker(self) -> None:
        return None  # no draft model: SGLang skips draft runners, weight-update fan-out, draft KV

    def alloc_memory_pool(self, **_: Any) -> None:
        _, allocator = self._target_worker.get_memory_pool()
        pool = allocator.get_kvcache()
        if not (hasattr(pool, "k_buffer") and hasattr(pool, "v_buffer")):
            raise RuntimeError(f"--speculative-algorithm DYNTREE needs an MHA token pool (k_buffer/v_buffer); this model "
                               f"uses {type(pool).__name__} (MLA, hybrid and SWA models are not supported yet)")
        self.kv_pool = pool

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        self.speculator.release(rid)
        self._decoding.discard(rid)

    def clear_cache_pool(self) -> None:
        for rid in list(self._decoding):
            self.speculator.release(rid)
        self._decoding.clear()

    # -- the one call SGLang's scheduler makes ------------------------------------------------------
    def forward_batch_generation(self, batch: Any, on_publish: Any = None, pp_proxy_tensors: Any = None,
                                 **_: Any) -> GenerationBatchResult:
        if batch.forward_mode.is_decode():
            result = self._decode(batch)
        else:
            result = self._prefill(batch, pp_proxy_tensors)
        if on_publish is not None:
            on_publish(result.new_seq_lens)
        return result

    def _prefill(self, batch: Any, pp_proxy_tensors: Any) -> GenerationBatchResult:
        for req in batch.reqs:
            problem = unsupported_request(req)
            if problem is not None:
                req.to_finish = FINISH_ABORT(f"--speculative-algorithm DYNTREE: {problem}", HTTPStatus.BAD_REQUEST,
                                             "BadRequestError")
        capture = CaptureHiddenMode.FULL if self.speculator.needs_hidden else None
        out = self._target_worker.forward_batch_generation(batch, pp_proxy_tensors=pp_proxy_tensors,
                                                           capture_hidden_mode=capture)
        if self.speculator.needs_hidden:
            hidden, start = out.logits_output.hidden_states, 0
            for req, prefix, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
                self.speculator.observe_hidden(req.rid, hidden[start: start + n], start=int(prefix))
                start += n
        bs = len(batch.reqs)
        accept_tokens = torch.zeros(bs, self.width, dtype=torch.int32, device=self.device)
        accept_tokens[:, 0] = out.next_token_ids
        accept_lens = torch.ones(bs, dtype=torch.int32, device=self.device)
        new_seq_lens = batch.seq_lens.clone()
        return GenerationBatchResult(
            logits_output=out.logits_output, next_token_ids=out.next_token_ids, can_run_cuda_graph=out.can_run_cuda_graph,
            accept_lens=accept_lens, new_seq_lens=new_seq_lens,
            next_draft_input=NgramVerifyInput(draft_token_num=self.width, new_seq_lens=new_seq_lens,
                                              accept_tokens=accept_tokens.flatten(), accept_lens=accept_lens),
            speculative_num_draft_tokens=self.width,
        )  # fmt: skip

    def _decode(self, batch: Any) -> GenerationBatchResult:
        reqs, dev = batch.reqs, self.device
        rids = [req.rid for req in reqs]
        for gone in self._decoding - set(rids):
            self.speculator.release(gone)
        self._decoding = set(rids)
        seq_lens = [int(s) for s in batch.seq_lens_cpu]
        spec_reqs = []
        for req, seq_len in zip(reqs, seq_lens):
            tokens = list(req.origin_input_ids_unpadded) + list(req.output_ids)
            if len(tokens) != seq_len + 1:
                raise RuntimeError(f"DYNTREE: request {req.rid} has {len(tokens)} tokens but {seq_len} in the KV cache "
                                   "(expected one more: the root)")
            spec_reqs.append(SpecRequest(req.rid, tokens, request_sampling(req.sampling_params), max_nodes=self.width - 1))
        self.batch = batch
        drafts = self.speculator.propose(spec_reqs, self.generator)
        n = max(tree.size for tree in drafts.trees)  # this step's verify width: the widest tree
        self.widths[n] += 1
        layout = verify_layout(drafts, seq_lens, n, self.ablate)
        draft_token = layout.draft_token.to(dev)

        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.input_ids = draft_token
        window = batch.seq_lens[:, None] + torch.arange(n, device=dev)[None, :]
        req_to_token = batch.req_to_token_pool.req_to_token
        batch.out_cache_loc = req_to_token[batch.req_pool_indices[:, None], window].flatten().to(torch.int64)
        batch.spec_info = DynTreeVerifyInput(
            draft_token=draft_token, custom_mask=layout.custom_mask(seq_lens, self.mask_mode, dev),
            positions=layout.positions.to(dev), retrieve_index=layout.retrieve_index.to(dev),
            retrieve_next_token=layout.retrieve_next_token.to(dev),
            retrieve_next_sibling=layout.retrieve_next_sibling.to(dev), draft_token_num=n,
            capture_hidden=self.speculator.needs_hidden,
        )  # fmt: skip
        t = time.perf_counter()
        out = self._target_worker.forward_batch_generation(batch, is_verify=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # the accept reads the logits next anyway: the time is the forward's
        logits_output = out.logits_output
        logits = logits_output.next_token_logits[layout.valid_rows.to(dev)]
        result = self.speculator.accept(drafts, logits, self.generator, forward_ms=(time.perf_counter() - t) * 1e3)

        if "compaction" not in self.ablate:
            index, lens = result.accept_index.to(dev), result.accept_len.to(dev)
            for layer in range(len(self.kv_pool.k_buffer)):
                kv_compact_sglang(self.kv_pool.k_buffer[layer], self.kv_pool.v_buffer[layer], req_to_token,
                                  batch.req_pool_indices, batch.seq_lens, index, lens)
        if self.speculator.needs_hidden:
            hidden = logits_output.hidden_states
            for b, rid in enumerate(rids):
                self.speculator.observe_hidden(rid, hidden[b * n + torch.tensor(result.accepted(b), device=dev)])
        accept_tokens, accept_lens = (x.to(dev) for x in commit_arrays(result, self.width))
        new_seq_lens = batch.seq_lens + accept_lens
        batch.forward_mode = ForwardMode.DECODE
        return GenerationBatchResult(
            logits_output=logits_output, next_token_ids=accept_tokens, can_run_cuda_graph=out.can_run_cuda_graph,
            accept_lens=accept_lens, new_seq_lens=new_seq_lens,
            next_draft_input=NgramVerifyInput(draft_token_num=self.width, new_seq_lens=new_seq_lens,
                                              accept_tokens=accept_tokens, accept_lens=accept_lens),
            speculative_num_draft_tokens=self.width,
        )  # fmt: skip


def _target_info(model: torch.nn.Module, server_args: Any, vocab: int) -> TargetInfo:
    """What Hydra borrows from SGLang's loaded model (weights shared, not copied)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server_args.tokenizer_path or server_args.model_path,
                                        trust_remote_code=bool(getattr(server_args, "trust_remote_code", False)))
    return TargetInfo.from_model(model, tok, str(server_args.model_path), vocab)
