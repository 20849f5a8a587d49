"""SGLang's scheduler and target worker, stood in on CPU for the DYNTREE worker tests.

SGLang cannot serve on this CPU (no CPU sgl-kernel, no AMX backend), so these tests drive the
real :class:`~dyntree.sglang_plugin.worker.DynTreeWorker` the way SGLang's synchronous spec-v2
scheduler does, against :class:`TokenPoolTarget`: SmolLM2's real weights run over an SGLang-style
token pool (``req_to_token`` slot ids -> per-layer ``k_buffer``/``v_buffer``), honouring what
SGLang's tree-capable attention backends honour in ``TARGET_VERIFY``: ``spec_info.positions``,
``batch.out_cache_loc`` for the window's KV, and ``spec_info.custom_mask`` (FULL_MASK or
QLEN_ONLY layout). Slots are handed out in shuffled order, so an indexing bug cannot hide
behind contiguous storage. The model the worker sees (``model_runner.model``) has SGLang's Llama
layout (:func:`sglang_llama`: stacked ``qkv_proj`` / ``gate_up_proj``, a ``cos_sin_cache`` rotary,
``attn.layer_id``) over SmolLM2's tensors, so the quantized self-draft reads the weights and the
token pool exactly as it would in SGLang.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Sequence

import torch
from torch import nn
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


class TokenPoolTarget:
    """SGLang's ``TpModelWorker`` for a HF Llama, over a token-pool KV cache (fp32, CPU)."""

    def __init__(self, model: torch.nn.Module, pool_size: int = 8192, max_reqs: int = 16, max_context: int = 2048,
                 seed: int = 0) -> None:
        self.model = model.eval()
        cfg = model.config
        self.hkv, self.hd = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
        self.hq = cfg.num_attention_heads
        layers = cfg.num_hidden_layers
        self.k_buffer = [torch.zeros(pool_size, self.hkv, self.hd) for _ in range(layers)]
        self.v_buffer = [torch.zeros(pool_size, self.hkv, self.hd) for _ in range(layers)]
        self.req_to_token = torch.zeros(max_reqs, max_context, dtype=torch.int32)
        self.free = torch.randperm(pool_size - 1, generator=torch.Generator().manual_seed(seed)).add(1).tolist()
        self.model_runner = SimpleNamespace(device="cpu", model=sglang_llama(model),
                                            model_config=SimpleNamespace(vocab_size=cfg.vocab_size))
        self.req_to_token_pool = SimpleNamespace(req_to_token=self.req_to_token)
        pool = SimpleNamespace(k_buffer=self.k_buffer, v_buffer=self.v_buffer)
        self.allocator = SimpleNamespace(get_kvcache=lambda: pool)

    def get_memory_pool(self) -> tuple[Any, Any]:
        return self.req_to_token_pool, self.allocator

    def alloc(self, n: int) -> torch.Tensor:
        slots, self.free = self.free[:n], self.free[n:]
        return torch.tensor(slots, dtype=torch.int32)

    # -- TpModelWorker.forward_batch_generation -------------------------------------------------
    @torch.inference_mode()
    def forward_batch_generation(self, batch: Any, pp_proxy_tensors: Any = None, is_verify: bool = False,
                                 capture_hidden_mode: CaptureHiddenMode | None = None) -> Any:
        bs = len(batch.reqs)
        loc = batch.out_cache_loc.long()
        if batch.forward_mode.is_target_verify():
            spec = batch.spec_info
            n = spec.draft_token_num
            positions = spec.positions
            seq = batch.seq_lens.tolist()
            masks = _split_mask(spec.custom_mask, seq, n)
            rows = [(b * n, n, s + n, masks[b]) for b, s in enumerate(seq)]
            mode = max(capture_hidden_mode or CaptureHiddenMode.NULL, spec.capture_hidden_mode)
        else:
            positions, rows, start = [], [], 0
            for b, (pre, ext) in enumerate(zip(batch.prefix_lens, batch.extend_lens)):
                positions.append(torch.arange(pre, pre + ext))
                causal = torch.tril(torch.ones(ext, pre + ext, dtype=torch.bool), diagonal=pre)
                rows.append((start, ext, pre + ext, causal))
                start += ext
            positions = torch.cat(positions)
            mode = capture_hidden_mode or CaptureHiddenMode.NULL
        kv_locs = [self.req_to_token[int(batch.req_pool_indices[b]), :length].long() for b, (_, _, length, _) in enumerate(rows)]
        hidden = self._forward(batch.input_ids.long(), positions.long(), loc, rows, kv_locs)
        logits = self.model.lm_head(hidden).float()
        if not batch.forward_mode.is_target_verify():
            last = torch.tensor([s + n - 1 for s, n, _, _ in rows])
            out_logits, out_hidden = logits[last], hidden if mode == CaptureHiddenMode.FULL else hidden[last]
        else:
            out_logits, out_hidden = logits, hidden
        logits_output = SimpleNamespace(next_token_logits=out_logits,
                                        hidden_states=out_hidden if mode != CaptureHiddenMode.NULL else None)
        next_ids = None if is_verify else out_logits.argmax(-1).to(torch.int32)
        assert len(rows) == bs
        return SimpleNamespace(logits_output=logits_output, next_token_ids=next_ids, can_run_cuda_graph=False)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, loc: torch.Tensor,
                 rows: Sequence[tuple[int, int, int, torch.Tensor]], kv_locs: list[torch.Tensor]) -> torch.Tensor:
        m = self.model.model
        x = m.embed_tokens(tokens)
        cos, sin = m.rotary_emb(x[None], positions[None])
        group = self.hq // self.hkv
        for li, layer in enumerate(m.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            t = h.shape[0]
            q = attn.q_proj(h).view(t, self.hq, self.hd).transpose(0, 1)[None]
            k = attn.k_proj(h).view(t, self.hkv, self.hd).transpose(0, 1)[None]
            v = attn.v_proj(h).view(t, self.hkv, self.hd)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            self.k_buffer[li][loc] = k[0].transpose(0, 1)
            self.v_buffer[li][loc] = v
            q = q[0].transpose(0, 1)  # [t, Hq, D]
            out = torch.empty_like(q)
            for (start, n, _, allowed), kl in zip(rows, kv_locs):
                kk = self.k_buffer[li][kl].repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
                vv = self.v_buffer[li][kl].repeat_interleave(group, dim=1).transpose(0, 1)
                qq = q[start: start + n].transpose(0, 1)  # [Hq, n, D]
                o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=allowed[None])
                out[start: start + n] = o.transpose(0, 1)
            x = x + attn.o_proj(out.reshape(t, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return m.norm(x)


class _Linear(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None


def _module(**parts: Any) -> nn.Module:
    m = nn.Module()
    for name, part in parts.items():
        setattr(m, name, part)
    return m


def sglang_llama(model: nn.Module) -> nn.Module:
    """SGLang's ``LlamaForCausalLM`` module layout over a HF Llama's tensors (q/k/v and gate/up
    stacked as SGLang's loader stacks them; norms, embeddings and LM head shared)."""
    cfg, inner = model.config, model.model
    hd = cfg.hidden_size // cfg.num_attention_heads
    freqs = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float32), inner.rotary_emb.inv_freq.float())
    rope = SimpleNamespace(cos_sin_cache=torch.cat([freqs.cos(), freqs.sin()], -1), is_neox_style=True, rotary_dim=hd,
                           head_size=hd)
    layers = []
    for i, layer in enumerate(inner.layers):
        a, m = layer.self_attn, layer.mlp
        attn = _module(qkv_proj=_Linear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])), o_proj=a.o_proj,
                       rotary_emb=rope, num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                       head_dim=hd, scaling=float(a.scaling), attn=SimpleNamespace(layer_id=i, sliding_window_size=-1))
        mlp = _module(gate_up_proj=_Linear(torch.cat([m.gate_proj.weight, m.up_proj.weight])), down_proj=m.down_proj)
        layers.append(_module(self_attn=attn, mlp=mlp, input_layernorm=layer.input_layernorm,
                              post_attention_layernorm=layer.post_attention_layernorm))
    decoder = _module(embed_tokens=inner.embed_tokens, layers=nn.ModuleList(layers), norm=inner.norm)
    return _module(model=decoder, lm_head=model.lm_head)


def _split_mask(mask: torch.Tensor, seq_lens: list[int], n: int) -> list[torch.Tensor]:
    """Per request ``[n, seq_len + n]`` bool, from FULL_MASK or QLEN_ONLY layout."""
    if mask.numel() == len(seq_lens) * n * n:  # QLEN_ONLY: tree block only, prefix implied
        return [torch.cat([torch.ones(n, s, dtype=torch.bool), blk], dim=1)
                for s, blk in zip(seq_lens, mask.view(-1, n, n))]
    out, start = [], 0
    for s in seq_lens:
        out.append(mask[start: start + n * (s + n)].view(n, s + n))
        start += n * (s + n)
    return out


class Req(SimpleNamespace):
    """The fields of SGLang's ``Req`` the worker reads."""


def greedy_params(**overrides: Any) -> SimpleNamespace:
    """SGLang's per-request sampling fields as its ``SamplingParams`` normalises greedy (top_k 1)."""
    return SimpleNamespace(**{**dict(temperature=1.0, top_k=1, top_p=1.0, min_p=0.0, frequency_penalty=0.0,
                                     presence_penalty=0.0, repetition_penalty=1.0, logit_bias=None, json_schema=None,
                                     regex=None, ebnf=None, structural_tag=None), **overrides})


def run_scheduler(worker: Any, target: TokenPoolTarget, prompts: Sequence[Sequence[int]], max_new: int,
                  chunked: bool = False, sampling: dict | None = None) -> dict:
    """Drive ``worker`` like SGLang's synchronous spec-v2 scheduler: prefill (in two chunks when
    ``chunked``), then decode batches until every request has ``max_new`` tokens (finished
    requests leave the batch). ``sampling`` overrides the requests' greedy sampling fields (the
    prefill's token stays the argmax)."""
    n = worker.width
    reqs = [Req(rid=f"r{i}", origin_input_ids_unpadded=list(p), output_ids=[], sampling_params=greedy_params(**(sampling or {})),
                return_logprob=False, to_finish=None) for i, p in enumerate(prompts)]
    assigned = [0] * len(reqs)

    def reserve(b: int, upto: int) -> None:
        if upto > assigned[b]:
            target.req_to_token[b, assigned[b]:upto] = target.alloc(upto - assigned[b])
            assigned[b] = upto

    lens = [len(p) for p in prompts]
    for b, length in enumerate(lens):
        reserve(b, length)
    cuts = [[0, length // 2, length] if chunked else [0, length] for length in lens]
    for c in range(len(cuts[0]) - 1):  # chunked prefill: SGLang drops the token sampled after a partial chunk
        pre, ext = [cut[c] for cut in cuts], [cut[c + 1] - cut[c] for cut in cuts]
        batch = SimpleNamespace(
            forward_mode=ForwardMode.EXTEND, reqs=reqs,
            input_ids=torch.tensor([t for p, a, e in zip(prompts, pre, ext) for t in p[a: a + e]]),
            out_cache_loc=torch.cat([target.req_to_token[b, a: a + e] for b, (a, e) in enumerate(zip(pre, ext))]).long(),
            seq_lens=torch.tensor(pre) + torch.tensor(ext), seq_lens_cpu=torch.tensor(pre) + torch.tensor(ext),
            prefix_lens=pre, extend_lens=ext, req_pool_indices=torch.arange(len(reqs)),
            req_to_token_pool=target.req_to_token_pool,
        )  # fmt: skip
        res = worker.forward_batch_generation(batch)
    for req, tok in zip(reqs, res.next_token_ids.tolist()):
        req.output_ids.append(tok)
    seq = {b: lens[b] for b in range(len(reqs))}
    steps, accepted = 0, 0
    while True:
        live = [b for b, r in enumerate(reqs) if len(r.output_ids) < max_new]
        if not live:
            break
        for b in live:
            reserve(b, seq[b] + n)
        seq_lens = torch.tensor([seq[b] for b in live])
        batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, reqs=[reqs[b] for b in live], seq_lens=seq_lens,
                                seq_lens_cpu=seq_lens.clone(), req_pool_indices=torch.tensor(live),
                                req_to_token_pool=target.req_to_token_pool, input_ids=None, out_cache_loc=None,
                                spec_info=None)
        res = worker.forward_batch_generation(batch)
        assert res.next_token_ids.shape == (len(live) * n,) and batch.forward_mode == ForwardMode.DECODE
        steps += 1
        for i, b in enumerate(live):
            k = int(res.accept_lens[i])
            toks = res.next_token_ids[i * n: i * n + k].tolist()
            reqs[b].output_ids.extend(toks[: max_new - len(reqs[b].output_ids)])
            seq[b] = int(res.new_seq_lens[i])
            accepted += k - 1
    return {"tokens": [r.output_ids for r in reqs], "steps": steps, "accepted": accepted}
