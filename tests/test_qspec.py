"""Tests for the quantized self-draft (dyntree.common.drafters.qspec with the Hugging Face backend
dyntree.standalone.selfdraft) on a tiny random Llama and, marked slow, on SmolLM2-135M."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from dyntree.common.builder import PartialTree, TreeBuilder
from dyntree.common.config import SamplingParams, SpecConfig
from dyntree.common.drafter import DraftRequest, NoDrafter
from dyntree.common.drafters import make_drafter
from dyntree.common.drafters.qspec import QSpecDrafter
from dyntree.common.options import TreeOptions
from dyntree.common.quant import QSpecError, QuantLinear, parse_qspec
from dyntree.common.speculator import SpecRequest, Speculator
from dyntree.standalone.engine import SpecEngine
from dyntree.standalone.selfdraft import HFSelfDraft


class _Tok:
    eos_token_id = None

    def decode(self, ids, **_):
        return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).eval()


PROMPTS = [[1, 5, 7, 9, 11, 3, 40, 41], [2, 4, 6], [8, 13]]


def _requests(prompts, max_nodes=10, max_depth=4):
    return [DraftRequest(i, p, max_nodes=max_nodes, max_depth=max_depth) for i, p in enumerate(prompts)]


def _prefilled(model, drafter=None, spec: SpecConfig | None = None, **engine_options) -> SpecEngine:
    """An engine where a verify step is about to start from PROMPTS (request ids 0, 1, 2; cache
    rows in that order): all but each prompt's last token cached, the last one the root. What a
    self-draft backend reads (``.model``, ``.cache``, ``cache_rows``, ``kv_len``) mid-generate."""
    engine = SpecEngine(model, _Tok(), drafter or NoDrafter(), spec, **engine_options)
    with torch.inference_mode():
        engine._prefill([p[:-1] for p in PROMPTS], [0, 1, 2], SamplingParams(), torch.Generator(), set(), None)
    for req, p in zip(engine._live, PROMPTS):  # the prefill's first token becomes the prompt's last
        req.tokens, req.out.token_ids = list(p), []
    return engine


def _attached(model, spec_text: str) -> tuple[QSpecDrafter, SpecEngine]:
    """A qspec drafter with an HF backend over a prefilled plain engine (no speculator involved),
    its weights materialized: the reference numbers, which the tests compare with."""
    engine = _prefilled(model)
    drafter = QSpecDrafter(parse_qspec(spec_text))
    drafter.attach(HFSelfDraft(engine, drafter.spec, materialize=True))
    return drafter, engine


def _reference(model: LlamaForCausalLM, spec_text: str) -> LlamaForCausalLM:
    """An independent dense model computing what the draft should: a deep copy with the kept
    layers' linears quantized the same way and the skipped layers removed."""
    spec = parse_qspec(spec_text)
    ref = copy.deepcopy(model)
    keep = len(ref.model.layers) - spec.skip_layers
    ref.model.layers = nn.ModuleList(list(ref.model.layers)[:keep])
    ref.config.num_hidden_layers = keep
    if spec.quantized:
        for layer in ref.model.layers:
            for name, mod in list(layer.named_modules()):
                for child_name, child in list(mod.named_children()):
                    if isinstance(child, nn.Linear):
                        setattr(mod, child_name, QuantLinear.from_linear(child, spec))
    return ref


def _reference_probs(target, ref, prompt: list[int], path: list[int]) -> torch.Tensor:
    """Next-token probs after ``prompt[:-1] + path`` (``path`` starts with the root): prefix KV
    from the target, the path through ``ref``."""
    n = len(prompt) - 1
    cache = target(torch.tensor([prompt[:-1]]), use_cache=True).past_key_values if n else None
    pos = torch.arange(n, n + len(path))[None]
    out = ref(torch.tensor([path]), position_ids=pos, past_key_values=cache, use_cache=True)
    return out.logits[0, -1].float().softmax(-1)


@pytest.mark.parametrize("spec_text", ["none", "w4a16,g32", "w8a16,perchannel,asym,skip=1", "w8a8,asym", "w4a4,g32"])
def test_draft_probs_equal_a_full_forward_of_the_draft_model(tiny, spec_text: str) -> None:
    # every node's draft prob must be what an independent reference computes: the *target's*
    # (full-precision) KV of the committed prefix, then the node's path through the reference
    # draft model one sequence at a time: checks prefix-KV reading, scratch KV, mask, positions.
    # The drafter's own trees (SpecConfig.tree unset: the builder's beam over its top-3, width 3)
    # through the engine's speculator, the engine's HFSelfDraft attached by SpecEngine, its
    # weights materialized: the reference numbers (the CPU kernels round activations to bf16).
    engine = _prefilled(tiny, QSpecDrafter(parse_qspec(spec_text), topk=3, width=3),
                        SpecConfig(drafter="qspec", max_nodes=10, max_depth=4), materialize_draft=True)
    assert isinstance(engine.drafter.backend, HFSelfDraft)
    cache = engine.cache
    before = [(layer.keys.clone(), layer.values.clone(), layer.keys.data_ptr()) for layer in cache.layers]
    trees = engine.speculator.propose([SpecRequest(i, p) for i, p in enumerate(PROMPTS)]).trees
    ref = _reference(tiny, spec_text)
    errs, firsts = [], []
    with torch.no_grad():
        for prompt, tree in zip(PROMPTS, trees):
            assert tree.root == prompt[-1] and tree.size - 1 == 10 and tree.max_depth <= 4
            for i in range(1, tree.size):
                path = [int(tree.tokens[j]) for j in tree.path(i)]
                probs = _reference_probs(tiny, ref, prompt, path[:-1])
                errs.append(abs(float(probs[path[-1]]) - float(tree.draft_probs[i])))
                firsts.append(tree.children(int(tree.parents[i]))[0] == i and path[-1] == int(probs.argmax()))
    assert len(errs) == 30
    # activation rounding is discontinuous: a last-bit difference between the batched draft
    # forward and the reference can move one activation by one step; allow a rare small flip
    n_off = sum(e > 1e-4 for e in errs)
    assert (n_off == 0 if parse_qspec(spec_text).act_bits is None else n_off <= 2) and max(errs) < 0.05
    assert sum(firsts) >= 9 - n_off  # each tree's first children are their parents' argmax
    for (k, v, ptr), layer in zip(before, cache.layers):  # the target's KV is read, never written
        assert torch.equal(k, layer.keys) and torch.equal(v, layer.values) and layer.keys.data_ptr() == ptr
    assert engine.drafter.backend.last_scratch_bytes > 0


def _backend(tiny, spec_text: str) -> HFSelfDraft:
    """The backend SpecEngine attaches to a qspec drafter."""
    return SpecEngine(tiny, _Tok(), QSpecDrafter(parse_qspec(spec_text))).drafter.backend


def test_memory_overhead_is_the_quantized_weights_only(tiny) -> None:
    linears = [m for m in tiny.model.layers.modules() if isinstance(m, nn.Linear)]
    assert _backend(tiny, "none").overhead_bytes == 0
    w4 = _backend(tiny, "w4a16,g32")
    # codes (4 bit) + fp16 scales, and the CPU kernel's packed copy: codes + bf16 scale and min
    quantized = sum(m.out_features * (m.in_features // 2) + m.out_features * (m.in_features // 32) * 2 for m in linears)
    packed = sum(m.out_features * (m.in_features // 2) + m.out_features * (m.in_features // 32) * 4 for m in linears)
    # the fused path keeps only the kernel's copies (the common-format codes are released), plus
    # its int8 LM head: codes + bf16 scales
    vocab, hidden = tiny.lm_head.weight.shape
    head = vocab * hidden + 2 * vocab
    assert w4.fused is not None and w4.kernel_layers == len(w4.quant_layers) == 3 * 4 + 1  # stacked QKV, gate/up
    assert w4.overhead_bytes == packed + head
    assert _backend(tiny, "w4a16,g32,skip=1").overhead_bytes == packed * 2 // 3 + head
    hf_path = HFSelfDraft(w4.engine, parse_qspec("w4a16,g32"), fused=False)
    assert hf_path.overhead_bytes == quantized + packed  # HF path: codes kept for the fallback
    assert w4.overhead_bytes < w4.target_bytes / 5  # fp32 target: ~1/8 + scales + the head
    # the draft shares everything else with the target
    assert w4.decoder.embed_tokens is tiny.model.embed_tokens and w4.decoder.norm is tiny.model.norm
    assert w4.decoder.layers[0].input_layernorm is tiny.model.layers[0].input_layernorm
    assert isinstance(tiny.model.layers[0].self_attn.q_proj, nn.Linear)  # target untouched


def _generate(model, drafter, max_nodes=4, max_depth=4, n=20, tree=None, engine_cls=SpecEngine, **sampling):
    spec = SpecConfig(drafter="x", max_nodes=max_nodes, max_depth=max_depth, tree=tree)
    engine = engine_cls(model, _Tok(), drafter, spec)
    return engine.generate(PROMPTS, SamplingParams(max_new_tokens=n, ignore_eos=True, **sampling))


@pytest.fixture(scope="module")
def plain(tiny) -> dict[int, list]:
    """Plain greedy decoding of PROMPTS, by max_new_tokens."""
    return {n: _generate(tiny, NoDrafter(), n=n) for n in (16, 20)}


#: accepted drafts per depth over 20 tokens when every draft is accepted (see below)
FULL = [4, 4, 4, 3]


def test_unquantized_self_draft_is_always_fully_accepted(tiny, plain) -> None:
    plain = plain[20]
    outs = _generate(tiny, QSpecDrafter(parse_qspec("none"), topk=1, width=1))
    for p, o in zip(plain, outs):
        assert o.token_ids == p.token_ids
        # the prefill's token, then 4 drafts + bonus per step: every step accepts all its drafts;
        # the last drafts 3 (a 4th would pass the 20-token limit): 1 + 5 + 5 + 5 + 4 tokens
        assert o.steps == 4 and o.accepted_per_depth == FULL


@pytest.mark.parametrize("spec_text", ["w4a4,g32,asym", "w8a16,skip=2"])
def test_quantized_self_draft_is_lossless(tiny, plain, spec_text: str) -> None:
    plain = plain[16]
    outs = _generate(tiny, QSpecDrafter(parse_qspec(spec_text)), max_nodes=8, n=16)
    assert [o.token_ids for o in outs] == [p.token_ids for p in plain]
    assert sum(o.steps for o in outs) < sum(p.steps for p in plain)  # the draft gets something right


def test_factory_and_errors(tiny) -> None:
    d = make_drafter("qspec:w4a8,g32,skip=1")  # no model: the engine attaches its forward later
    assert isinstance(d, QSpecDrafter) and str(d.spec) == "w4a8,g32,sym,skip=1" and d.backend is None
    assert d.needs_self_draft and d.drafts_with_builder and not d.has_own_trees
    assert str(make_drafter("qspec").spec) == "w8a16,perchannel,sym"
    with pytest.raises(QSpecError, match="weight bits must be 4 or 8"):
        make_drafter("qspec:w3a16")
    # without the engine's backend it cannot draft, nor be handed to a speculator
    roots = [PartialTree([r.root], [-1], [0]) for r in _requests(PROMPTS)]
    with pytest.raises(ValueError, match="the engine must attach a SelfDraftBackend"):
        d.expand(_requests(PROMPTS), [[0]] * 3, roots, 4, None)
    with pytest.raises(ValueError, match="attach the engine's SelfDraftBackend"):
        Speculator(d, SpecConfig(drafter="qspec"), vocab_size=96)
    with pytest.raises(NotImplementedError, match="does not propose whole trees"):
        d.propose(_requests(PROMPTS))  # its own trees are the builder's beam shape
    engine = SpecEngine(tiny, _Tok(), d)
    assert isinstance(d.backend, HFSelfDraft) and len(d.backend.decoder.layers) == 2
    with pytest.raises(QSpecError, match="skip=3 must leave at least one of the target's 3 layers"):
        SpecEngine(tiny, _Tok(), make_drafter("qspec:none,skip=3"))
    # a zero node budget: root-only trees, the draft is never run (no prefill needed)
    batch = engine.speculator.propose([SpecRequest(i, p, max_nodes=0) for i, p in enumerate(PROMPTS)])
    assert [t.size for t in batch.trees] == [1, 1, 1] and engine.speculator.stats.expand_s == 0.0


def _built_trees(tiny, drafter_spec, mode, sampling, max_nodes=10, max_depth=4):
    """Trees grown by a TreeBuilder over the qspec drafter's ``expand`` for PROMPTS (greedy
    candidates, i.e. the plain softmax, also when the builder samples from them)."""
    drafter, engine = _attached(tiny, drafter_spec)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in engine.cache.layers]
    reqs = _requests(PROMPTS, max_nodes, max_depth)
    calls = []

    def expand(frontiers, partials, k):
        calls.append([len(f) for f in frontiers])
        cands = drafter.expand(reqs, frontiers, partials, k, None)
        assert cands.ids.shape == (sum(calls[-1]), k)  # flat over the batch, top-k
        return cands.split([len(f) for f in frontiers])

    options = TreeOptions(entropy_low=0.0, entropy_high=1.0)
    trees = TreeBuilder(options).build_batch([r.root for r in reqs], expand, budgets=[(max_nodes, max_depth)] * len(reqs),
                                             mode=mode, sampling=sampling, vocab_size=96,
                                             generator=torch.Generator().manual_seed(3))
    return trees, (engine.cache, before), calls, options


@pytest.mark.parametrize("mode,sampling", [("dyntree", False), ("static", True)])
def test_expand_probs_equal_a_full_forward_of_the_draft_model(tiny, mode: str, sampling: bool) -> None:
    # like the own-tree test, for trees the builder shapes: every expanded node's draft
    # probability must be the reference draft model's on its path. Greedy trees keep the
    # candidates' probabilities as they are; sampled trees draw from (and carry, as draft_dists)
    # the top-``sampling_support`` candidates renormalised, so they are compared with the
    # reference renormalised over its own top ``sampling_support`` tokens
    trees, (cache, before), calls, options = _built_trees(tiny, "w4a16,g32", mode, sampling)
    ref = _reference(tiny, "w4a16,g32")
    support = options.sampling_support
    assert len(calls) <= 4 and max(calls[1]) > 1  # one call per depth, several nodes per tree
    n_checked = 0
    with torch.no_grad():
        for prompt, tree in zip(PROMPTS, trees):
            assert tree.root == prompt[-1] and 1 < tree.size <= 11 and tree.max_depth <= 4
            assert any(len(tree.children(i)) > 1 for i in range(tree.size))  # a real tree, not a chain
            assert (tree.draft_dists is not None) == sampling
            for i in range(1, tree.size):
                parent = int(tree.parents[i])
                probs = _reference_probs(tiny, ref, prompt, [int(tree.tokens[j]) for j in tree.path(parent)])
                if sampling:
                    top = torch.topk(probs, support)
                    probs = torch.zeros_like(probs).index_add_(0, top.indices, top.values / top.values.sum())
                    assert torch.allclose(tree.draft_dists[parent], probs, atol=1e-4)
                assert float(tree.draft_probs[i]) == pytest.approx(float(probs[int(tree.tokens[i])]), abs=1e-4)
                n_checked += 1
    assert n_checked >= 15
    for (k, v), layer in zip(before, cache.layers):  # the target's KV is read, never written
        assert torch.equal(k, layer.keys) and torch.equal(v, layer.values)


class _Recording(SpecEngine):
    """Engine that keeps every (tree, accepted local nodes) its speculator verified."""

    seen: list = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        accept = self.speculator.accept

        def recording_accept(batch, *a, **kw):
            res = accept(batch, *a, **kw)
            type(self).seen.extend((tree, res.accepted(b)) for b, tree in enumerate(batch.trees))
            return res

        self.speculator.accept = recording_accept


def test_unquantized_self_draft_in_tree_modes_is_always_fully_accepted(tiny, plain) -> None:
    plain = plain[20]
    chain = _generate(tiny, QSpecDrafter(parse_qspec("none")), tree="chain")
    for p, o in zip(plain, chain):
        assert o.token_ids == p.token_ids and o.steps == 4 and o.accepted_per_depth == FULL
    _Recording.seen = []
    outs = _generate(tiny, QSpecDrafter(parse_qspec("none")), max_nodes=8, tree="dyntree", engine_cls=_Recording)
    assert [o.token_ids for o in outs] == [p.token_ids for p in plain]
    branched = 0
    assert _Recording.seen
    for tree, accepted in _Recording.seen:
        # draft == target: the accepted path follows the draft's argmax (rank-0) children for as
        # long as the tree holds one (measured values may keep lower ranks instead), then stops
        path = [0]
        while best := [i for i in tree.children(path[-1]) if int(tree.ranks[i]) == 0]:
            path.append(best[0])
        assert accepted == path
        branched += any(len(tree.children(i)) > 1 for i in range(tree.size))
    assert branched > 0 and sum(o.steps for o in outs) < sum(p.steps for p in plain)


def test_unquantized_self_draft_sampling_accepts_every_draw(tiny) -> None:
    # sampling: the chain is drawn from the draft's distribution and carries it; with draft ==
    # target the acceptance ratio p/q is 1, so every draft is accepted
    outs = _generate(tiny, QSpecDrafter(parse_qspec("none")), tree="chain", temperature=1.0, top_k=20, seed=5)
    for o in outs:
        assert len(o.token_ids) == 20 and o.steps == 4 and o.accepted_per_depth == FULL


@pytest.mark.parametrize("mode", ["chain", "static", "dyntree"])
def test_quantized_self_draft_tree_modes_are_lossless(tiny, plain, mode: str) -> None:
    plain = plain[16]
    outs = _generate(tiny, QSpecDrafter(parse_qspec("w4a8,g32,asym")), max_nodes=8, n=16, tree=mode)
    assert [o.token_ids for o in outs] == [p.token_ids for p in plain]
    assert sum(o.steps for o in outs) < sum(p.steps for p in plain)


def test_expand_errors(tiny) -> None:
    d, _ = _attached(tiny, "none")
    reqs = _requests(PROMPTS)
    roots = [PartialTree([r.root], [-1], [0]) for r in reqs]
    with pytest.raises(ValueError, match="the engine must attach a SelfDraftBackend"):
        QSpecDrafter(parse_qspec("none")).expand(reqs, [[0]] * 3, roots, 4, None)
    grown = [PartialTree([r.root, 5, 6], [-1, 0, 1], [0, 1, 2]) for r in reqs]
    with pytest.raises(ValueError, match="no step was started"):
        d.expand(reqs, [[1]] * 3, grown, 4, None)
    out = d.expand(reqs, [[0], [], [0]], roots, 5, None)
    assert tuple(out.ids.shape) == (2, 5) and tuple(out.entropy.shape) == (2,)  # flat: one row per frontier node
    assert [tuple(c.ids.shape) for c in out.split([1, 0, 1])] == [(1, 5), (0, 5), (1, 5)]
    assert bool((out.probs[:, :-1] >= out.probs[:, 1:]).all())  # most likely first
    with pytest.raises(ValueError, match="ancestor 1 was never a frontier node"):
        d.expand(reqs, [[2], [], []], grown, 4, None)
    with pytest.raises(ValueError, match="frontier node 0 is not a new node"):
        d.expand(reqs, [[0], [], []], grown, 4, None)  # node 0 was forwarded already this step
    d.expand(reqs, [[0]] * 3, roots, 4, None)
    assert d.backend.last_scratch_bytes > 0
    d.expand(reqs, [[1]] * 3, grown, 4, None)  # the step goes on: node 1's ancestor 0 has draft KV
    d.observe(0, PROMPTS[0], 0)  # the step was verified: its draft state is gone
    with pytest.raises(ValueError, match="no step was started"):
        d.expand(reqs, [[1]] * 3, grown, 4, None)
    # other requests than the step's: no step for them either
    d.expand(reqs, [[0]] * 3, roots, 4, None)
    with pytest.raises(ValueError, match="no step was started"):
        d.expand(reqs[:2], [[1]] * 2, grown[:2], 4, None)
    # the backend checks the request against the engine's cache row
    stale = [DraftRequest(0, PROMPTS[0][:-1], max_nodes=10, max_depth=4)]
    with pytest.raises(ValueError, match="has kv_len=6, the engine's cache row holds 7"):
        d.expand(stale, [[0]], [PartialTree([stale[0].root], [-1], [0])], 4, None)
    # the target's vocabulary bounds candidate ids: the builder refuses ids past it
    small = int(d.expand(reqs[:1], [[0]], roots[:1], 1, None).ids[0, 0])  # the root's best candidate
    sp = Speculator(d, SpecConfig(drafter="qspec", max_nodes=4, max_depth=2), vocab_size=small)
    with pytest.raises(ValueError, match=rf"must lie in \[0, {small}\)"):
        sp.propose([SpecRequest(0, PROMPTS[0])])


@pytest.mark.slow
@pytest.mark.parametrize("tree,spec_text", [(None, "w4a16,g128,sym"), ("dyntree", "w4a16,g128,sym"),
                                            (None, "w8a16,perchannel"), ("chain", "w4a16,g64")])
def test_greedy_lossless_on_smollm2(tree, spec_text) -> None:
    from dyntree.models import load_model

    model, tok = load_model("smollm2", torch.float32)
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fibonacci(n):")]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    plain = SpecEngine(model, tok, NoDrafter()).generate(prompts, params)
    # g128 does not divide SmolLM2's K=576: no CPU kernel, so materialized (the reference numbers,
    # several times faster than dequantizing on every call); the others run the CPU kernels
    # through the fused draft layers
    drafter = QSpecDrafter(parse_qspec(spec_text))
    cfg = SpecConfig(drafter="qspec", max_nodes=8, max_depth=4, tree=tree)
    engine = SpecEngine(model, tok, drafter, cfg, materialize_draft="g128" in spec_text)
    assert (engine.drafter.backend.fused is not None) == ("g128" not in spec_text)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [p.token_ids for p in plain]
    assert sum(o.step_tokens for o in outs) / sum(o.steps for o in outs) > 1.5  # tau


def test_fused_draft_layers_compute_what_the_hf_layers_do(tiny) -> None:
    # the fused layers (stacked QKV and gate/up, torch rms_norm, GQA SDPA) against HF's own layer
    # code over the same quantized weights and kernel: same numbers up to float rounding; and
    # the comparison can fail (positions shifted by 3 change the logits)
    engine = _prefilled(tiny)
    spec = parse_qspec("w4a16,g32")
    fused, hf = HFSelfDraft(engine, spec), HFSelfDraft(engine, spec, fused=False)
    assert fused.fused is not None and len(fused.fused) == 3 and hf.fused is None
    assert hf.kernel_layers == 21 and fused.kernel_layers == 3 * 4 + 1  # HF: 7 projections; fused: 4 + LM head
    hf.lm_head = fused.lm_head  # the fused path's int8 LM head on both: the layers are compared
    reqs = _requests(PROMPTS)
    tokens = torch.tensor([[p[-1], 5] for p in PROMPTS])  # each root and one child
    positions = torch.tensor([[len(p) - 1, len(p)] for p in PROMPTS])
    mask = torch.tensor([[True, False], [True, True]]).expand(3, 2, 2)
    committed = [(layer.keys.clone(), layer.values.clone()) for layer in engine.cache.layers]
    outs = []
    for backend, shift in ((fused, 0), (hf, 0), (fused, 3)):
        backend.reset(reqs)
        assert all(backend._kv._lent)  # the draft writes into the engine's free cache slots
        outs.append(backend.forward(tokens, positions + shift, mask))
        backend.release()
    for layer, (k, v) in zip(engine.cache.layers, committed):  # and never into its committed ones
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v) and layer.store.used == k.shape[2]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(outs[2], outs[0], atol=1e-2)


def test_fused_norm_and_rotary_equal_the_references() -> None:
    # the draft's RMSNorm (x / ||x|| times the scaled weight, no epsilon) and rotary (roll, sign
    # folded into sin) against torch's RMSNorm and Hugging Face's rotate-half form; and they can fail
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from dyntree.common.fused_draft import hf_rope, norm_weight, rms_norm

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 3, 64, generator=g) * 3, torch.rand(64, generator=g) + 0.5
    torch.testing.assert_close(rms_norm(x, norm_weight(w)), nn.functional.rms_norm(x, (64,), w, 1e-6))
    assert not torch.allclose(rms_norm(x, norm_weight(w)), nn.functional.layer_norm(x, (64,), w, None, 1e-6))
    assert not torch.allclose(rms_norm(x, w), nn.functional.rms_norm(x, (64,), w, 1e-6))  # the weight is scaled
    q, k = torch.randn(2, 4, 3, 16, generator=g), torch.randn(2, 2, 3, 16, generator=g)
    angles = torch.rand(2, 3, 8, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos, sin)
    rope = hf_rope(cos, sin)
    torch.testing.assert_close(rope(q), ref_q)
    torch.testing.assert_close(rope(k), ref_k)
    assert not torch.allclose(hf_rope(cos, -sin)(q), ref_q, atol=1e-3)


def test_scratch_kv_copy_once_equals_concatenating_every_call() -> None:
    # a step's forwards against one prefix: the buffered cache (prefix copied once, room grown
    # past its first 16 slots) and one writing into a lent buffer (the prefix's own, 6 free slots:
    # it moves to a copy at the third call) return exactly what per-call concatenation returns,
    # and the lent buffer's prefix slots are never written
    from dyntree.common.fused_draft import ScratchKV
    from dyntree.common.kv_store import KVStore

    g = torch.Generator().manual_seed(0)
    lent = [KVStore(torch.randn(2, 2, 3, 26, 8, generator=g), 20) for _ in range(2)]
    prefix = [(s.keys[:, :, :20], s.values[:, :, :20]) for s in lent]
    before = [(k.clone(), v.clone()) for k, v in prefix]
    caches = ScratchKV(2), ScratchKV(2, copy_budget=0), ScratchKV(2)
    for i, store in enumerate(lent):
        caches[2].lend(i, store, 20)
    for width in (1, 4, 10, 7):
        new = [(torch.randn(2, 3, width, 8, generator=g), torch.randn(2, 3, width, 8, generator=g)) for _ in range(2)]
        outs = []
        for cache in caches:
            cache.prefix = list(prefix)
            outs.append([cache.update(k, v, i) for i, (k, v) in enumerate(new)])
            cache.prefix = [None, None]
        for other in outs[1:]:
            for (k0, v0), (k1, v1) in zip(outs[0], other):
                assert torch.equal(k0, k1) and torch.equal(v0, v1)
        if width == 4:  # 5 draft slots: still in the lent buffers
            assert all(o[0].data_ptr() == s.keys.data_ptr() for o, s in zip(outs[2], lent))
    assert all(o[0].data_ptr() != s.keys.data_ptr() for o, s in zip(outs[2], lent))  # moved to a copy
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(prefix, before))
    assert [s.used for s in lent] == [20, 20]
    assert outs[0][0][0].shape[2] == 20 + 22
    assert caches[0].scratch_bytes == caches[1].scratch_bytes > 0
    for cache in caches:
        cache.prefix = list(prefix)
    assert caches[0].get_seq_length(1) == caches[1].get_seq_length(1) == 20 + 22
    assert caches[0].peak_transient_bytes >= 2 * 2 * (2 * 3 * 42 * 8 * 4)  # both layers' copies held
    assert 0 < caches[1].peak_transient_bytes <= 2 * (2 * 3 * 42 * 8 * 4)  # one layer's, for one call
