"""The standalone speculative engine over a Hugging Face transformers causal LM.

One decoding step for a batch of requests:

0. with ``SpecConfig.adaptive``, the :class:`~dyntree.common.controller.SpeculationController`
   sets each request's node/depth budget (zero: plain decoding) from its recent acceptance and a
   cost model of the target forward (timed at start-up, refined after every step);
1. the drafter proposes one :class:`DraftTree` per request, rooted at its last committed token:
   with ``SpecConfig.tree`` unset by its own :meth:`~Drafter.propose`, otherwise the
   :class:`~dyntree.common.builder.TreeBuilder` grows a ``chain`` / ``static`` / ``dyntree``
   tree from the drafter's :meth:`~Drafter.expand_batch` scores (shaped by the same
   temperature/top-k/top-p as the target; sampled trees carry ``draft_dists``);
2. ONE target forward verifies all trees: tree tokens sit at positions ``kv_len + depth`` and
   attend to their request's committed KV plus their own ancestors (a 4-D additive mask);
3. greedy (or lossless sampling) verification picks the accepted path and the bonus token; the
   outcome feeds the builder's calibration and the controller;
4. the accepted nodes' KV is compacted to the slots right after the request's prefix and the
   rest of the tree's KV is dropped;
5. new tokens are committed one by one so EOS, the token limit and stop strings end a request
   exactly where plain decoding would, even inside an accepted run.

A request whose tree is just its root is plain decoding; the ``none`` drafter makes the same
engine the baseline that benchmarks compare against.

Hidden states for the drafter: with ``needs_hidden`` each request carries the target's last-layer
state at the token before the root; with ``needs_new_hidden`` also the states of every committed
token not yet handed to the drafter (the prompt positions from the prefill, then the accepted
nodes of each verify step, in path order), kept until a step actually calls the drafter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Sequence

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from dyntree.common.builder import BuiltTree, PartialTree, TreeBuilder
from dyntree.common.config import SamplingParams, SpecConfig
from dyntree.common.controller import CostModel, Plan, SpeculationController
from dyntree.common.drafter import DraftRequest, Drafter
from dyntree.common.sampling import process_logits, sample_verify
from dyntree.common.tree import DraftTree, TreeBatch
from dyntree.common.verify import VerifyResult, greedy_verify
from dyntree.standalone import kv

__all__ = ["RequestOutput", "SpecEngine", "ABLATIONS", "COST_SIZES", "COST_KV_LEN"]

#: Test controls that each remove one piece of tree verification; outputs must then diverge.
ABLATIONS = frozenset({"mask", "positions", "compaction"})

#: Start-up cost model: query-token counts timed, against a dummy KV cache of this many tokens.
COST_SIZES = (1, 4, 16, 64, 256)
COST_KV_LEN = 256


@dataclass
class RequestOutput:
    """A finished request: its tokens, text, why it stopped, and its speculation statistics."""

    request_id: Hashable
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    steps: int = 0  # target forwards that verified this request (prefill not counted)
    draft_nodes: int = 0  # draft nodes proposed in total
    accepted_per_depth: list[int] = field(default_factory=list)  # accepted drafts at depth 1, 2, ...

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify forward, bonus included (1.0 = plain decoding)."""
        return len(self.token_ids) / self.steps if self.steps else 0.0


@dataclass
class _Live:
    """Engine-side state of a request still decoding."""

    out: RequestOutput
    tokens: list[int]  # prompt + generated; the last one is the next tree's root
    kv_len: int  # committed tokens whose KV is cached (len(tokens) - 1)
    hidden: torch.Tensor | None  # last-layer state that produced the root
    # with drafter.needs_new_hidden: states at positions kv_len - n .. kv_len - 1 (n rows in all)
    # not yet handed to the drafter, in chunks in position order
    pending: list[torch.Tensor] = field(default_factory=list)


class SpecEngine:
    """Tree speculative decoding for a transformers causal LM on one device."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        drafter: Drafter,
        spec: SpecConfig | None = None,
        ablate: Iterable[str] = (),
        cost_model: CostModel | None = None,
    ) -> None:
        """``cost_model`` (ms of one target forward vs. query tokens) is used by the adaptive
        controller; without one it is measured on the first adaptive ``generate`` and kept."""
        self.model = model
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.spec = spec or SpecConfig()
        self.ablate = frozenset(ablate)
        if not self.ablate <= ABLATIONS:
            raise ValueError(f"unknown ablation(s) {sorted(self.ablate - ABLATIONS)}; known: {sorted(ABLATIONS)}")
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        if self.spec.tree is not None and not drafter.drafts_with_builder:
            raise ValueError(
                f"SpecConfig.tree={self.spec.tree!r} needs a drafter with expand_batch; drafter "
                f"{drafter.name!r} has none (leave tree unset to use its own trees)"
            )
        self.builder = TreeBuilder(self.spec.builder_options()) if self.spec.tree is not None else None
        self.vocab_size = self.lm_head.out_features
        self._cost = cost_model
        self.controller: SpeculationController | None = None
        # draft_s: plan + drafting (expand_s of it inside the drafter); verify_s: forward, verify, KV
        self.timing = {"draft_s": 0.0, "expand_s": 0.0, "verify_s": 0.0, "forward_s": 0.0, "steps": 0}

    # -- public API ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        request_ids: Sequence[Hashable] | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Decode a batch of tokenized prompts together; returns outputs in prompt order."""
        params = params or SamplingParams()
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        ids = list(request_ids) if request_ids is not None else list(range(len(prompts)))
        if len(ids) != len(prompts) or len(set(ids)) != len(ids):
            raise ValueError("request_ids must be unique, one per prompt")
        gen = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)
        self.prepare()
        eos = self._eos_ids(params)
        live, cache = self._prefill(prompts, ids)
        done: dict[Hashable, RequestOutput] = {}
        bar = tqdm(total=len(prompts), desc="requests", disable=not progress, leave=False)
        with torch.inference_mode():
            while live:
                trees, results, hidden = self._step(live, cache, params, gen)
                keep = []
                for row, (req, tree, res) in enumerate(zip(live, trees, results)):
                    self._keep_hidden(req, hidden[row], res)
                    self._commit(req, res, params, eos)
                    self._learn(req.out.request_id, req.tokens, tree, res)
                    if req.out.finish_reason:
                        done[req.out.request_id] = req.out
                        self.drafter.release(req.out.request_id)
                        if self.controller is not None:
                            self.controller.release(req.out.request_id)
                        bar.update(1)
                    else:
                        keep.append(row)
                if len(keep) < len(live):
                    live = [live[r] for r in keep]
                    if live:
                        kv.select_rows(cache, torch.tensor(keep, device=self.device))
                if live:
                    kv.crop(cache, max(r.kv_len for r in live))
        bar.close()
        outs = [done[i] for i in ids]
        for o in outs:
            o.text = self._text(o, params)
        return outs

    def prepare(self) -> float:
        """Set up the adaptive controller (timing the cost model unless one was given); returns
        the seconds it took. ``generate`` calls it; call it first to keep that out of timings."""
        if not self.spec.adaptive or self.controller is not None:
            return 0.0
        t = time.perf_counter()
        self._cost = self._cost or self.measure_cost()
        # this engine pads every tree of a batch to the widest: price plans that way
        self.controller = SpeculationController(self._cost, self.spec.controller_options(), padded=True)
        return time.perf_counter() - t

    # -- one step ------------------------------------------------------------------------------
    def _step(
        self, live: list[_Live], cache: DynamicCache, params: SamplingParams, gen: torch.Generator
    ) -> tuple[list[DraftTree], list[VerifyResult], torch.Tensor]:
        """Draft, verify and compact once; returns the trees, the verify results and the verify
        forward's last-layer hidden states ``[B, T, d]`` (row ``b``, node ``i`` of tree ``b``)."""
        t0 = time.perf_counter()
        trees = self._draft(live, cache, params, gen)
        t1 = time.perf_counter()
        batch = TreeBatch.from_trees(trees)
        prefix = kv.seq_len(cache)
        kv_lens = torch.tensor([r.kv_len for r in live])
        depth = batch.depths if "positions" not in self.ablate else torch.arange(batch.width).expand_as(batch.depths)
        positions = kv_lens[:, None] + depth
        hidden = self._forward(batch.tokens, positions, self._tree_mask(batch, kv_lens, prefix), cache)
        logits = self.lm_head(hidden).float()
        self._sync()
        t2 = time.perf_counter()
        if self.controller is not None:
            self.controller.observe_step(batch.tokens.numel(), (t2 - t1) * 1e3)
            self.controller.observe_draft(int(batch.depths.max()), sum(t.size - 1 for t in trees), (t1 - t0) * 1e3)
        results = [self._verify(t, logits[r, : t.size], params, gen) for r, t in enumerate(trees)]
        self._compact(cache, live, results, prefix)
        self.timing["draft_s"] += t1 - t0
        self.timing["forward_s"] += t2 - t1
        self.timing["verify_s"] += time.perf_counter() - t1
        self.timing["steps"] += 1
        for req, tree, res in zip(live, trees, results):
            req.out.steps += 1
            req.out.draft_nodes += tree.size - 1
            for d in range(1, len(res.accepted_nodes)):
                if len(req.out.accepted_per_depth) < d:
                    req.out.accepted_per_depth.append(0)
                req.out.accepted_per_depth[d - 1] += 1
        return trees, results, hidden

    def _draft(self, live: list[_Live], cache: DynamicCache, params: SamplingParams, gen: torch.Generator) -> list[DraftTree]:
        spec = self.spec
        ids = [r.out.request_id for r in live]
        plans = self.controller.plan(ids) if self.controller is not None else None
        requests = [
            DraftRequest(
                request_id=r.out.request_id,
                token_ids=r.tokens,
                max_nodes=plans[row].max_nodes if plans else spec.max_nodes,
                max_depth=plans[row].max_depth if plans else spec.max_depth,
                hidden=r.hidden if self.drafter.needs_hidden else None,
                row=row,
                kv_len=r.kv_len,
                new_hidden=torch.cat(r.pending) if r.pending else None,
            )
            for row, r in enumerate(live)
        ]
        target_kv = cache if self.drafter.needs_target_kv else None
        if all(r.max_nodes == 0 or r.max_depth == 0 for r in requests):
            trees: list[DraftTree] = [DraftTree.root_only(r.root) for r in requests]
            handed: set[int] = set()
        elif self.builder is not None:
            trees, handed = self._build(requests, plans, target_kv, params, gen)
        else:
            trees, handed = self.drafter.propose(requests, target_kv), set(range(len(requests)))
        for row in handed:
            live[row].pending.clear()
        if len(trees) != len(requests):
            raise RuntimeError(f"drafter {self.drafter.name!r} returned {len(trees)} trees for {len(requests)} requests")
        for req, tree in zip(requests, trees):
            if tree.root != req.root or tree.size - 1 > req.max_nodes or tree.max_depth > req.max_depth:
                raise RuntimeError(
                    f"drafter {self.drafter.name!r} broke its budget or root: root {tree.root} "
                    f"(want {req.root}), {tree.size - 1} nodes (max {req.max_nodes}), depth "
                    f"{tree.max_depth} (max {req.max_depth})"
                )
        return trees

    def _build(
        self,
        requests: list[DraftRequest],
        plans: list[Plan] | None,
        target_kv: object,
        params: SamplingParams,
        gen: torch.Generator,
    ) -> tuple[list[DraftTree], set[int]]:
        """Grow the trees with the builder: one ``expand_batch`` call per depth per tree mode
        (a controller's chain plans are grown as chains, its tree plans in ``SpecConfig.tree``).
        Returns the trees and the rows of the requests the drafter was handed (a mode group
        whose trees cannot grow at all never calls it)."""
        assert self.builder is not None and self.spec.tree is not None
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            mode = "chain" if plans is not None and plans[i].mode == "chain" else self.spec.tree
            groups.setdefault(mode, []).append(i)
        trees: list[DraftTree] = [DraftTree.root_only(r.root) for r in requests]
        handed: set[int] = set()
        for mode, rows in groups.items():
            reqs = [requests[i] for i in rows]

            def expand(frontiers: list[list[int]], partials: list[PartialTree]) -> list[torch.Tensor]:
                t = time.perf_counter()
                handed.update(rows)
                raw = self.drafter.expand_batch(reqs, frontiers, partials, self.vocab_size, target_kv)
                self.timing["expand_s"] += time.perf_counter() - t
                return [self._draft_probs(x, params) for x in raw]

            built = self.builder.build_batch(
                [r.root for r in reqs], expand, budgets=[(r.max_nodes, r.max_depth) for r in reqs],
                mode=mode, sampling=not params.greedy, generator=gen,
            )  # fmt: skip
            for i, tree in zip(rows, built):
                trees[i] = tree
        return trees, handed

    @staticmethod
    def _draft_probs(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Draft probabilities from a drafter's logits, shaped like the target's (greedy: plain
        softmax); rows of all ``-inf`` (no candidate) become all-zero rows."""
        scores = scores.float().cpu()
        if params.greedy:  # softmax that leaves dead rows at zero (no NaN), in few dense passes
            top = scores.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
            e = torch.exp(scores - top)
            return e / e.sum(dim=-1, keepdim=True).clamp_min(1e-30)
        dead = torch.isneginf(scores.amax(dim=-1))
        if bool(dead.any()):
            scores = scores.clone()
            scores[dead] = 0.0
        probs = process_logits(scores, params.temperature, params.top_k, params.top_p)
        probs[dead] = 0.0
        return probs

    def _learn(self, request_id: Hashable, tokens: list[int], tree: DraftTree, res: VerifyResult) -> None:
        """Feed one verified tree to the drafter, the builder's calibration and the controller."""
        self.drafter.observe(request_id, tokens, res.accepted_drafts)
        if self.builder is not None and isinstance(tree, BuiltTree) and tree.size > 1:
            self.builder.observe(tree, res.accepted_nodes)
        if self.controller is not None:
            self.controller.observe(request_id, tree, res.accepted_nodes)

    def _tree_mask(self, batch: TreeBatch, kv_lens: torch.Tensor, prefix: int) -> torch.Tensor:
        """``[B, 1, T, prefix + T]`` additive mask: committed prefix + ancestors (or causal)."""
        b, t = batch.tokens.shape
        see_prefix = (torch.arange(prefix)[None, :] < kv_lens[:, None])[:, None, :].expand(b, t, prefix)
        if "mask" in self.ablate:  # control: plain causal attention over the flattened tree
            see_tree = torch.tril(torch.ones(t, t, dtype=torch.bool)).expand(b, t, t) & batch.valid[:, None, :]
            see_tree = see_tree | torch.eye(t, dtype=torch.bool)
        else:
            see_tree = batch.mask
        allowed = torch.cat([see_prefix & batch.valid[:, :, None], see_tree], dim=-1)
        return self._additive(allowed)

    def _verify(self, tree: DraftTree, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> VerifyResult:
        if params.greedy:
            return greedy_verify(tree, logits.argmax(dim=-1))
        probs = process_logits(logits, params.temperature, params.top_k, params.top_p)
        return sample_verify(tree, probs, gen, self.spec.tree_options.sampling_scheme)

    def _compact(self, cache: DynamicCache, live: list[_Live], results: list[VerifyResult], prefix: int) -> None:
        rows, src, dst = [], [], []
        for row, (req, res) in enumerate(zip(live, results)):
            n = len(res.accepted_nodes)
            nodes = res.accepted_nodes if "compaction" not in self.ablate else list(range(n))
            rows += [row] * n
            src += [prefix + i for i in nodes]
            dst += range(req.kv_len, req.kv_len + n)
            req.kv_len += n
        as_t = lambda x: torch.tensor(x, device=self.device)  # noqa: E731
        kv.compact(cache, as_t(rows), as_t(src), as_t(dst))

    # -- cost model ------------------------------------------------------------------------------
    def measure_cost(self, sizes: Sequence[int] = COST_SIZES, kv_len: int = COST_KV_LEN, repeats: int = 2) -> CostModel:
        """Time target forwards (decoder + LM head) of ``sizes`` query tokens against a dummy KV
        cache of ``kv_len`` tokens; the cost model the adaptive controller starts from."""
        cache = DynamicCache()
        g = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            dummy = torch.randint(0, self.vocab_size, (1, kv_len), generator=g)
            causal = torch.tril(torch.ones(kv_len, kv_len, dtype=torch.bool))[None]
            self._forward(dummy, torch.arange(kv_len)[None], self._additive(causal), cache)

            def forward(n: int) -> None:
                toks = torch.randint(0, self.vocab_size, (1, n), generator=g)
                allowed = torch.ones(1, n, kv_len + n, dtype=torch.bool)
                self.lm_head(self._forward(toks, kv_len + torch.arange(n)[None], self._additive(allowed), cache))
                self._sync()
                kv.crop(cache, kv_len)

            return CostModel.measure(forward, sizes, repeats, lr=self.spec.controller.cost_lr)

    def _sync(self) -> None:
        """Wait for queued GPU work, so that wall-clock timings measure it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- prefill and commit ----------------------------------------------------------------------
    def _prefill(self, prompts: Sequence[Sequence[int]], ids: Sequence[Hashable]) -> tuple[list[_Live], DynamicCache]:
        """Cache every prompt token but the last, which becomes the first tree's root."""
        cache = DynamicCache()
        lens = torch.tensor([len(p) - 1 for p in prompts])
        width = int(lens.max())
        live = [
            _Live(RequestOutput(i, list(p)), list(p), int(n), None) for i, p, n in zip(ids, prompts, lens)
        ]
        if width == 0:
            return live, cache
        tokens = torch.zeros(len(prompts), width, dtype=torch.int64)
        for r, p in enumerate(prompts):
            tokens[r, : len(p) - 1] = torch.tensor(p[:-1])
        valid = torch.arange(width)[None, :] < lens[:, None]
        causal = torch.tril(torch.ones(width, width, dtype=torch.bool))
        allowed = (causal[None] & valid[:, None, :] & valid[:, :, None]) | torch.eye(width, dtype=torch.bool)
        positions = torch.arange(width).expand(len(prompts), width)
        with torch.inference_mode():
            hidden = self._forward(tokens, positions, self._additive(allowed), cache)
        for r, req in enumerate(live):
            if req.kv_len > 0:
                req.hidden = hidden[r, req.kv_len - 1].clone()
                if self.drafter.needs_new_hidden:
                    req.pending.append(hidden[r, : req.kv_len].clone())
        return live, cache

    def _keep_hidden(self, req: _Live, hidden: torch.Tensor, res: VerifyResult) -> None:
        """Keep a verified request's hidden states from its row ``hidden`` ``[T, d]`` of the verify
        forward: the last accepted node's (it produced the new root) and, for drafters that ask,
        every accepted node's (root included, in path order: the positions just compacted)."""
        req.hidden = hidden[res.accepted_nodes[-1]].clone()
        if self.drafter.needs_new_hidden:
            req.pending.append(hidden[res.accepted_nodes].clone())

    def _commit(self, req: _Live, res: VerifyResult, params: SamplingParams, eos: set[int]) -> None:
        """Append new tokens one at a time, stopping exactly where plain decoding would."""
        out = req.out
        for tok in res.tokens:
            out.token_ids.append(tok)
            req.tokens.append(tok)
            if tok in eos:
                out.finish_reason = "stop"
            elif params.stop and self._hit_stop(out.token_ids, params.stop):
                out.finish_reason = "stop"
            elif len(out.token_ids) >= params.max_new_tokens:
                out.finish_reason = "length"
            if out.finish_reason:
                return

    # -- helpers -------------------------------------------------------------------------------
    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        out = self.decoder(
            input_ids=tokens.to(self.device),
            position_ids=positions.to(self.device),
            attention_mask=mask.to(self.device),
            past_key_values=cache,
            use_cache=True,
        )
        return out.last_hidden_state

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """bool ``[B, Q, K]`` -> additive ``[B, 1, Q, K]`` mask in the model dtype."""
        mask = torch.zeros(allowed.shape, dtype=self.dtype)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask[:, None]

    def _eos_ids(self, params: SamplingParams) -> set[int]:
        if params.ignore_eos:
            return set()
        ids = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids |= set(gen_eos) if isinstance(gen_eos, (list, tuple)) else ({gen_eos} if gen_eos is not None else set())
        return ids

    def _hit_stop(self, token_ids: list[int], stops: Sequence[str]) -> bool:
        window = 4 * max(len(s) for s in stops) + 8  # a byte-level token holds >= 1 byte of UTF-8
        tail = self.tokenizer.decode(token_ids[-window:], skip_special_tokens=True)
        return any(s in tail for s in stops)

    def _text(self, out: RequestOutput, params: SamplingParams) -> str:
        text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        cut = [text.find(s) for s in params.stop if s in text]
        return text[: min(cut)] if cut else text
