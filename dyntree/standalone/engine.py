"""The standalone engine: a Hugging Face transformers causal LM driven by the speculator.

The prefill caches every prompt token and commits the first new token from the last one's logits
(:meth:`Speculator.first_tokens <dyntree.common.speculator.Speculator.first_tokens>`), as plain
decoding does. The engine only translates: per step it hands its live requests to
:meth:`Speculator.propose <dyntree.common.speculator.Speculator.propose>`, runs ONE target forward
over every tree of the batch (ragged: the trees back to back as one sequence, so a request pays
the linears for its own nodes only; tree tokens at positions ``kv_len + depth``, each attending to
its request's committed KV plus its own ancestors through a 4-D additive mask; see
:mod:`~dyntree.standalone.kv`),
hands the logits to :meth:`~dyntree.common.speculator.Speculator.accept`, then moves the accepted
nodes' KV right behind each request's prefix (dropping the rest of the tree's), pushes their
hidden states to the speculator when the drafter reads them, and commits the new tokens one by one
so EOS, the token limit and stop strings end a request exactly where plain decoding would, even
inside an accepted run.

With ``max_batch_size`` a request that finishes leaves its cache row and the next waiting prompt
is prefilled and joins the batch (continuous batching, as a server runs); without it every prompt
decodes in one batch until the last finishes. Prompts that join at once are prefilled in groups of
similar length (:func:`prefill_groups`), so padding costs at most a quarter of their tokens.

A request whose tree is just its root is plain decoding; the ``none`` drafter makes the same
engine the baseline that benchmarks compare against. A ``qspec`` drafter gets the engine's
:class:`~dyntree.standalone.selfdraft.HFSelfDraft` forward attached.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Generator, Hashable, Iterable, Iterator, Sequence

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from dyntree import progress
from dyntree.kernels import cpu_attention as attention, cpu_linear as linear
from dyntree.kernels.cpu_attention import AttentionDispatch
from dyntree.common.config import SamplingParams, SpecConfig
from dyntree.common.cost_model import CostModel
from dyntree.common.drafter import Drafter
from dyntree.common.speculator import AcceptResult, SpecRequest, Speculator
from dyntree.common.tree import DraftBatch, TreeBatch
from dyntree.models import cache_root
from dyntree.standalone import kv
from dyntree.standalone.attention import DISPATCH, LAYOUT, attention_scope
from dyntree.standalone.selfdraft import HFSelfDraft

__all__ = ["RequestOutput", "SpecEngine", "prefill_groups", "ABLATIONS", "COST_SIZES", "COST_KV_LEN", "COST_KV_LONG"]

#: Test controls that each remove one piece of tree verification; outputs must then diverge.
ABLATIONS = frozenset({"mask", "positions", "compaction"})

#: Start-up cost model: query-token counts timed, against a dummy KV cache of this many tokens.
COST_SIZES = (1, 2, 4, 8, 16, 64, 256)
COST_KV_LEN = 256
#: ... and one of them against this many, which prices attention over longer prefixes.
COST_KV_LONG = 1024
#: ... and batches of this many one-token requests against both (each request reads its own cache).
COST_ROWS = 8
#: Prompts joining at once are prefilled together only while padding adds at most 25% to their tokens.
PREFILL_SLACK = 1.25


def prefill_groups(lengths: Sequence[int], slack: float = PREFILL_SLACK) -> list[list[int]]:
    """Indices of prompts to prefill together: by length, each group's padded size (its longest
    prompt x its size) at most ``slack`` x its real tokens, so a long prompt joining short ones
    does not make them all pay its length."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda j: (lengths[j], j)):
        g = groups[-1] if groups else None
        if g is not None and lengths[i] * (len(g) + 1) <= slack * (sum(lengths[j] for j in g) + lengths[i]):
            g.append(i)
        else:
            groups.append([i])
    return groups


def _cpu_linears(model: torch.nn.Module) -> tuple[linear.LinearDispatch, linear.LinearRouter] | None:
    """The model's linear routing and the router its linears were installed with, calibrated and
    installed once per model object (timings cached on disk); ``None`` where ``F.linear`` is the
    fastest at every row count (the linears stay untouched)."""
    if not hasattr(model, "_dyntree_linears"):
        dispatch = linear.calibrate(model, cache_dir=cache_root() / "linear", announce=progress.step)
        routing = None
        if dispatch.routes:
            routing = dispatch, linear.LinearRouter()
            linear.install(model, routing[1], dispatch.packs)
        model._dyntree_linears = routing
    return model._dyntree_linears


def _cpu_attention(model: torch.nn.Module) -> AttentionDispatch:
    """The model's attention routing, calibrated once per model object (timings cached on disk)."""
    have = getattr(model, "_dyntree_attention_dispatch", None)
    if have is None:
        cfg = model.config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        have = model._dyntree_attention_dispatch = attention.calibrate(
            heads, getattr(cfg, "num_key_value_heads", None) or heads, head_dim, next(model.parameters()).dtype,
            cache_dir=cache_root() / "attention", announce=progress.step)
    return have


@dataclass
class RequestOutput:
    """A finished request: its tokens, text, why it stopped, and its speculation statistics."""

    request_id: Hashable
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    steps: int = 0  # verify forwards of this request (the prefill, which gives the first token, not counted)
    draft_nodes: int = 0  # draft nodes proposed in total
    accepted_per_depth: list[int] = field(default_factory=list)  # accepted drafts at depth 1, 2, ...

    @property
    def step_tokens(self) -> int:
        """Tokens the verify steps committed: all but the first, which the prefill gives."""
        return max(len(self.token_ids) - 1, 0)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify forward, bonus included (1.0 = plain decoding)."""
        return self.step_tokens / self.steps if self.steps else 0.0


@dataclass
class _Live:
    """Engine-side state of a request still decoding."""

    out: RequestOutput
    tokens: list[int]  # prompt + generated; the last one is the next tree's root
    kv_len: int  # committed tokens whose KV is cached (len(tokens) - 1)


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
        materialize_draft: bool = False,
        fast_linear: bool = True,
        fast_attention: bool = True,
    ) -> None:
        """``cost_model`` (ms of one target forward vs. query tokens) is used by the adaptive
        controller; without one it is measured on the first adaptive ``generate`` and kept.
        ``materialize_draft``: a ``qspec`` draft keeps dense copies of its quantized weights
        (same numbers, faster on CPU). ``fast_linear``: on a CPU, the engine's forwards (and the
        drafter's) route linears through a :mod:`~dyntree.kernels.cpu_linear` dispatch calibrated once
        per model (``model.generate`` outside the engine is untouched). ``fast_attention``: on a
        CPU, the engine's forwards attend through a :mod:`~dyntree.kernels.cpu_attention` dispatch
        calibrated once per model (no per-group K/V copies; the fastest kernel per shape)."""
        self.model = model
        self.tokenizer = tokenizer
        self.spec = spec or SpecConfig()
        self.ablate = frozenset(ablate)
        if not self.ablate <= ABLATIONS:
            raise ValueError(f"unknown ablation(s) {sorted(self.ablate - ABLATIONS)}; known: {sorted(ABLATIONS)}")
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache = kv.GrowingCache()
        self._live: list[_Live] = []
        self.prefill_s = 0.0  # seconds the last ``generate`` spent in prefills
        cpu = self.device.type == "cpu"
        routing = _cpu_linears(model) if fast_linear and cpu else None
        self.linear, self._router = routing if routing is not None else (None, None)
        self.attention = _cpu_attention(model) if fast_attention and cpu else None
        drafter.route_linears(self.linear)
        if drafter.needs_self_draft:
            spec_q = getattr(drafter, "spec")
            drafter.attach(HFSelfDraft(self, spec_q, materialize=materialize_draft))
        self.speculator = Speculator(
            drafter, self.spec, vocab_size=self.lm_head.out_features,
            cost_model=cost_model or self.measure_cost if self.spec.adaptive else None, rectangular_kv=True,
        )  # fmt: skip

    @property
    def drafter(self) -> Drafter:
        return self.speculator.drafter

    # -- public API ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        request_ids: Sequence[Hashable] | None = None,
        progress: bool = False,
        on_commit: Callable[[Hashable, list[int]], None] | None = None,
        max_batch_size: int | None = None,
    ) -> list[RequestOutput]:
        """Decode tokenized prompts; returns outputs in prompt order.

        Without ``max_batch_size`` all prompts decode in one batch. With it, at most that many
        decode at once: the rest wait in prompt order and each joins (prefilled between two steps)
        as soon as a request finishes, so the batch stays full until the queue is empty.
        ``on_commit(request_id, new_token_ids)`` is called after every step that committed tokens
        to a request (for streaming); a request's last call holds its last token."""
        work = self.stepwise(prompts, params, request_ids, progress, on_commit, max_batch_size)
        with self.kernel_scope():  # the model's attention switched once, not per step
            while True:
                try:
                    next(work)
                except StopIteration as done:
                    return done.value

    def stepwise(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        request_ids: Sequence[Hashable] | None = None,
        progress: bool = False,
        on_commit: Callable[[Hashable, list[int]], None] | None = None,
        max_batch_size: int | None = None,
    ) -> Generator[None, None, list[RequestOutput]]:
        """:meth:`generate` one unit of work (a prefill or a decoding step) per ``next()``; the
        outputs are the ``StopIteration`` value. A caller can interleave several engines step by
        step (``dyntree bench --lockstep``): each unit runs inside this engine's kernel scope and
        holds no scope across a ``yield``; a loop inside the :meth:`kernel_scope` of an engine over
        the same model switches the model's attention once rather than per unit. The
        arguments are checked at the call."""
        params = params or SamplingParams()
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        ids = list(request_ids) if request_ids is not None else list(range(len(prompts)))
        if len(ids) != len(prompts) or len(set(ids)) != len(ids):
            raise ValueError("request_ids must be unique, one per prompt")
        gen = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)
        return self._stepwise(prompts, ids, params, gen, progress, on_commit, max_batch_size or len(prompts))

    def _stepwise(self, prompts: Sequence[Sequence[int]], ids: list[Hashable], params: SamplingParams,
                  gen: torch.Generator, progress: bool, on_commit: Callable[[Hashable, list[int]], None] | None,
                  max_batch: int) -> Generator[None, None, list[RequestOutput]]:
        if not prompts:
            return []
        with self.kernel_scope():
            self.prepare()
        self.prefill_s = 0.0
        eos = self.eos_ids(params)
        done: dict[Hashable, RequestOutput] = {}
        waiting = list(zip(ids, prompts))
        bar = tqdm(total=len(prompts), desc="requests", disable=not progress, leave=False)
        self.cache, self._live = kv.GrowingCache(), []
        while waiting or self._live:
            with torch.inference_mode(), self.kernel_scope():
                if waiting and len(self._live) < max_batch:
                    join, waiting = waiting[: max_batch - len(self._live)], waiting[max_batch - len(self._live) :]
                    t0 = time.perf_counter()
                    for group in prefill_groups([len(p) for _, p in join]):
                        self._prefill([join[j][1] for j in group], [join[j][0] for j in group], params, gen, eos,
                                      on_commit)
                    self.prefill_s += time.perf_counter() - t0
                else:
                    self._step(params, gen, eos, on_commit, waiting=len(waiting))
                self._retire(done, bar)
            yield
        bar.close()
        self.cache = kv.GrowingCache()
        outs = [done[i] for i in ids]
        for o in outs:
            o.text = self._text(o, params)
        return outs

    def _retire(self, done: dict[Hashable, RequestOutput], bar: tqdm) -> None:
        """Move finished requests to ``done`` and out of the batch (and the cache)."""
        keep = []
        for row, req in enumerate(self._live):
            if req.out.finish_reason:
                stats = self.speculator.release(req.out.request_id)
                req.out.steps, req.out.draft_nodes = stats.steps, stats.proposed
                req.out.accepted_per_depth = stats.accepted_per_depth
                done[req.out.request_id] = req.out
                bar.update(1)
            else:
                keep.append(row)
        if len(keep) < len(self._live):
            self._live = [self._live[r] for r in keep]
            if self._live:
                kv.select_rows(self.cache, torch.tensor(keep, device=self.device))
        if self._live:
            kv.crop(self.cache, max(r.kv_len for r in self._live))

    def prepare(self) -> float:
        """Set up the adaptive controller (timing the cost model unless one was given); returns
        the seconds it took. ``generate`` calls it; call it first to keep that out of timings."""
        return self.speculator.prepare()

    @contextmanager
    def kernel_scope(self) -> Iterator[None]:
        """The block in which the model's linears and attention take the calibrated CPU routing."""
        with self._router.using(self.linear) if self._router is not None else nullcontext():
            with attention_scope(self.model):
                yield

    def attention_kwargs(self, layout: kv.RaggedLayout | None = None) -> dict[str, object]:
        """What a forward of the model passes on to the engine's attention: its routing, and a
        ragged forward's layout."""
        return {DISPATCH: self.attention, LAYOUT: layout}

    # -- what the self-draft backend reads -----------------------------------------------------
    def cache_rows(self, request_ids: Sequence[Hashable]) -> list[int]:
        """The cache rows of live requests."""
        row = {r.out.request_id: i for i, r in enumerate(self._live)}
        return [row[rid] for rid in request_ids]

    def kv_len(self, row: int) -> int:
        return self._live[row].kv_len

    # -- one step ------------------------------------------------------------------------------
    def _step(self, params: SamplingParams, gen: torch.Generator, eos: set[int],
              on_commit: Callable[[Hashable, list[int]], None] | None = None, waiting: int | None = None) -> None:
        """Propose, verify in one forward, compact the KV, commit (``waiting``: prompts not yet in the batch)."""
        live = self._live
        reqs = [SpecRequest(r.out.request_id, r.tokens, params, remaining=params.max_new_tokens - len(r.out.token_ids))
                for r in live]
        batch = self.speculator.propose(reqs, gen, waiting)
        t1 = time.perf_counter()
        prefix = kv.seq_len(self.cache)
        kv_lens = torch.tensor([r.kv_len for r in live])
        layout = kv.RaggedLayout.from_indptr(batch.qo_indptr)
        positions = batch.positions(kv_lens) if "positions" not in self.ablate else kv_lens[layout.rows] + layout.cols
        mask = self._tree_mask(batch.padded(), kv_lens, prefix)
        if layout.width == 1:  # one token per row (no request drafted): a [B, 1] batch, not a ragged one
            hidden = self._forward(batch.tokens[:, None], positions[:, None], mask, self.cache)[:, 0]
        else:
            with kv.ragged(self.cache, layout):
                hidden = self._forward(batch.tokens[None], positions[None], mask, self.cache, layout)[0]
        logits = self.lm_head(hidden)  # model dtype: argmax is exact, sampling casts
        self._sync()
        result = self.speculator.accept(batch, logits, gen, forward_ms=(time.perf_counter() - t1) * 1e3)
        self._compact(batch, result, prefix)
        for b, req in enumerate(live):
            if self.speculator.needs_hidden:
                self.speculator.observe_hidden(req.out.request_id, hidden[batch.flat_index(b, result.accepted(b))])
            req.kv_len += int(result.accept_len[b])
            before = len(req.out.token_ids)
            self._commit(req, result.tokens[b], params, eos)
            if on_commit is not None:
                on_commit(req.out.request_id, req.out.token_ids[before:])

    def _tree_mask(self, batch: TreeBatch, kv_lens: torch.Tensor, prefix: int) -> torch.Tensor | None:
        """``[B, 1, T, prefix + T]`` additive mask: committed prefix + ancestors (or causal);
        ``None`` for a one-token forward that hides nothing (plain decoding at batch 1, or of rows
        of one length), which the engine's attention runs unmasked."""
        b, t = batch.tokens.shape
        see_prefix = (torch.arange(prefix)[None, :] < kv_lens[:, None])[:, None, :].expand(b, t, prefix)
        if "mask" in self.ablate:  # control: plain causal attention over the flattened tree
            see_tree = torch.tril(torch.ones(t, t, dtype=torch.bool)).expand(b, t, t) & batch.valid[:, None, :]
            see_tree = see_tree | torch.eye(t, dtype=torch.bool)
        else:
            see_tree = batch.mask
        allowed = torch.cat([see_prefix & batch.valid[:, :, None], see_tree], dim=-1)
        if t == 1 and bool(allowed.all()):
            return None
        return self._additive(allowed)

    def _compact(self, batch: DraftBatch, result: AcceptResult, prefix: int) -> None:
        """Copy each request's accepted nodes (tree slot ``prefix + i``) to the slots right after
        its committed KV (the ``compaction`` ablation keeps the first nodes instead)."""
        rows, src, dst = [], [], []
        for b, req in enumerate(self._live):
            n = int(result.accept_len[b])
            nodes = result.accepted(b) if "compaction" not in self.ablate else list(range(n))
            moves = [(prefix + i, req.kv_len + k) for k, i in enumerate(nodes) if prefix + i != req.kv_len + k]
            rows += [b] * len(moves)  # a node already in its slot (plain decoding at batch 1) stays
            src += [m[0] for m in moves]
            dst += [m[1] for m in moves]
        if rows:
            as_t = lambda x: torch.tensor(x, device=self.device)  # noqa: E731
            kv.compact(self.cache, as_t(rows), as_t(src), as_t(dst))

    # -- cost model ------------------------------------------------------------------------------
    def measure_cost(self, sizes: Sequence[int] | None = None, kv_len: int = COST_KV_LEN, repeats: int = 3) -> CostModel:
        """Time target forwards (decoder + LM head) of ``sizes`` query tokens against a dummy KV
        cache of ``kv_len`` tokens, and forwards of one request and of :data:`COST_ROWS` requests
        against ``kv_len`` and ``COST_KV_LONG`` tokens (the attention terms); the cost model the
        adaptive controller starts from. By default :data:`COST_SIZES` and the token counts on
        either side of each step of the CPU linear routing (e.g. 3 and 4 where 4 rows switch to
        packed weights), which interpolation would smooth over."""
        if sizes is None:
            steps = self.linear.steps() if self.linear is not None else []
            sizes = sorted(set(COST_SIZES) | {n for n in steps if n <= max(COST_SIZES)})
        g = torch.Generator().manual_seed(0)
        caches: dict[tuple[int, int], kv.GrowingCache] = {}

        def cache_for(rows: int, length: int) -> kv.GrowingCache:
            """A dummy cache of ``rows`` copies of one ``length``-token prefix (built once)."""
            if (rows, length) not in caches:
                cache = kv.GrowingCache()
                dummy = torch.randint(0, self.lm_head.out_features, (1, length), generator=g)
                causal = torch.tril(torch.ones(length, length, dtype=torch.bool))[None]
                self._forward(dummy, torch.arange(length)[None], self._additive(causal), cache)
                kv.select_rows(cache, torch.zeros(rows, dtype=torch.int64, device=self.device))
                caches[rows, length] = cache
            return caches[rows, length]

        def forward(rows: int, n: int, length: int) -> None:
            cache = cache_for(rows, length)
            toks = torch.randint(0, self.lm_head.out_features, (rows, n), generator=g)
            allowed = torch.ones(rows, n, length + n, dtype=torch.bool)
            positions = (length + torch.arange(n))[None].expand(rows, n)
            self.lm_head(self._forward(toks, positions, self._additive(allowed), cache))
            self._sync()
            kv.crop(cache, length)

        with progress.step(f"timing the target's forward at {len(sizes)} sizes for the adaptive controller"), \
                torch.inference_mode(), self.kernel_scope():
            return CostModel.measure(lambda n: forward(1, n, kv_len), sizes, repeats, lr=self.spec.controller.cost_lr,
                                     kv_forward=forward, kv_ref=kv_len, kv_long=COST_KV_LONG, rows=COST_ROWS)

    def _sync(self) -> None:
        """Wait for queued GPU work, so that wall-clock timings measure it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- prefill and commit ----------------------------------------------------------------------
    def _prefill(self, prompts: Sequence[Sequence[int]], ids: Sequence[Hashable], params: SamplingParams,
                 gen: torch.Generator, eos: set[int],
                 on_commit: Callable[[Hashable, list[int]], None] | None) -> None:
        """Cache every prompt token and commit the first new token from the last one's logits
        (as plain decoding does); the first verify step then starts from that token. The new
        requests join the live batch as its last rows (their cache rows appended)."""
        cache = kv.GrowingCache()
        lens = torch.tensor([len(p) for p in prompts])
        width = int(lens.max())
        joining = [_Live(RequestOutput(i, list(p)), list(p), int(n)) for i, p, n in zip(ids, prompts, lens)]
        tokens = torch.zeros(len(prompts), width, dtype=torch.int64)
        for r, p in enumerate(prompts):
            tokens[r, : len(p)] = torch.tensor(p)
        valid = torch.arange(width)[None, :] < lens[:, None]
        causal = torch.tril(torch.ones(width, width, dtype=torch.bool))
        allowed = (causal[None] & valid[:, None, :] & valid[:, :, None]) | torch.eye(width, dtype=torch.bool)
        positions = torch.arange(width).expand(len(prompts), width)
        hidden = self._forward(tokens, positions, self._additive(allowed), cache)
        if self._live:
            kv.append_rows(self.cache, cache)
        else:
            self.cache = cache
        self._live += joining
        last = hidden[torch.arange(len(prompts)), lens - 1]
        firsts = self.speculator.first_tokens([SpecRequest(r.out.request_id, r.tokens, params) for r in joining],
                                              self.lm_head(last), gen)
        for r, (req, tok) in enumerate(zip(joining, firsts)):
            if self.speculator.needs_hidden:
                self.speculator.observe_hidden(req.out.request_id, hidden[r, : req.kv_len])
            self._commit(req, [tok], params, eos)
            if on_commit is not None:
                on_commit(req.out.request_id, [tok])

    def _commit(self, req: _Live, tokens: list[int], params: SamplingParams, eos: set[int]) -> None:
        """Append new tokens one at a time, stopping exactly where plain decoding would."""
        out = req.out
        for tok in tokens:
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
    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                 cache: DynamicCache, layout: kv.RaggedLayout | None = None) -> torch.Tensor:
        """The decoder over ``tokens``; ``mask`` ``None`` only for one token per row that sees its
        whole row of the cache (the engine's attention scope then skips the mask); ``layout``: a
        ragged forward's (inside :func:`~dyntree.standalone.kv.ragged` on ``cache``). Where this
        many rows take ``F.linear`` anyway, the linears skip their routing."""
        plain_rows = self.linear is not None and self.linear.route(tokens.numel())[0] == linear.LINEAR
        with self._router.using(None) if plain_rows and self._router is not None else nullcontext():
            out = self.decoder(
                input_ids=tokens.to(self.device),
                position_ids=positions.to(self.device),
                attention_mask=None if mask is None else mask.to(self.device),
                past_key_values=cache,
                use_cache=True,
                **self.attention_kwargs(layout),
            )
        return out.last_hidden_state

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """bool ``[B, Q, K]`` -> additive ``[B, 1, Q, K]`` mask in the model dtype."""
        mask = torch.zeros(allowed.shape, dtype=self.dtype)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask[:, None]

    def eos_ids(self, params: SamplingParams) -> set[int]:
        """The token ids that end a request (none with ``ignore_eos``)."""
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
