"""Exactness on the real model, SmolLM2-135M-Instruct in fp32 (the issue's acceptance test).

Greedy tree speculation with the n-gram drafter must equal plain greedy decoding token for token
on 20 Spec-Bench prompts x 64 new tokens at batch sizes 1 and 4, and with continuous batching
(n-gram, Hydra, qspec); each ablation control must make
outputs diverge; EOS, token limits and stop strings must cut exactly where plain decoding does,
even inside an accepted run.
"""

from __future__ import annotations

import pytest

from spec_support import OracleDrafter
from dyntree.common.config import SamplingParams, SpecConfig
from dyntree.common.drafters import make_drafter
from dyntree.standalone import kv
from dyntree.standalone.engine import SpecEngine
from dyntree.standalone.target import make_hf_drafter

pytestmark = pytest.mark.slow
NEW = 64


def _run(smol, prompts, drafter, batch, params=None, ablate=(), spec=None):
    model, tok = smol
    params = params or SamplingParams(max_new_tokens=NEW)
    eng = SpecEngine(model, tok, drafter, spec or SpecConfig(), ablate=ablate)
    outs = []
    for i in range(0, len(prompts), batch):
        outs += eng.generate(prompts[i : i + batch], params, request_ids=list(range(i, min(i + batch, len(prompts)))))
    return outs


@pytest.fixture(scope="module")
def plain(smol, smol_prompts):
    return _run(smol, smol_prompts, make_drafter("none"), batch=1)


@pytest.mark.parametrize("batch", [1, 4])
def test_ngram_trees_equal_plain_greedy(smol, smol_prompts, plain, batch: int) -> None:
    assert len(smol_prompts) >= 20
    spec = _run(smol, smol_prompts, make_drafter("ngram"), batch)
    mismatched = [i for i, (a, b) in enumerate(zip(spec, plain)) if a.token_ids != b.token_ids]
    assert not mismatched, f"prompts {mismatched} differ from plain greedy decoding"
    assert all(len(o.token_ids) == NEW or o.finish_reason == "stop" for o in spec)
    assert sum(o.step_tokens for o in spec) / sum(o.steps for o in spec) > 1.05  # it really speculated
    assert any(len(o.accepted_per_depth) >= 3 for o in spec)


def test_plain_batch_equals_plain_single(smol, smol_prompts, plain) -> None:
    batched = _run(smol, smol_prompts[:8], make_drafter("none"), batch=4)
    assert [o.token_ids for o in batched] == [o.token_ids for o in plain[:8]]


@pytest.mark.parametrize("drafter", ["ngram", "hydra", "hydra+ngram", "qspec"])
def test_continuous_batching_equals_plain(smol, smol_prompts, plain, drafter: str, monkeypatch) -> None:
    """At most 3 requests decode at once; finished ones hand their slot to the next prompt, whose
    prefill joins a batch that is mid-decode (cache rows appended, padded to the longest)."""
    model, tok = smol
    joins = []
    append = kv.append_rows
    monkeypatch.setattr(kv, "append_rows", lambda cache, new: (joins.append(1), append(cache, new)))
    eng = SpecEngine(model, tok, make_hf_drafter(drafter, model, tok), SpecConfig(drafter=drafter))
    outs = eng.generate(smol_prompts[:8], SamplingParams(max_new_tokens=NEW), max_batch_size=3)
    assert [o.token_ids for o in outs] == [p.token_ids for p in plain[:8]]
    assert joins, "no request joined a live batch"


@pytest.mark.parametrize("piece", ["mask", "positions", "compaction"])
def test_ablation_controls_diverge(smol, smol_prompts, plain, piece: str) -> None:
    """Branching trees whose accepted path is never the first nodes; removing one piece of
    tree verification must change the output on at least one prompt."""
    prompts, refs = smol_prompts[:4], {i: plain[i].token_ids for i in range(4)}
    drafter = OracleDrafter(refs, {i: len(p) for i, p in enumerate(prompts)}, decoys=2)
    params = SamplingParams(max_new_tokens=32)
    good = _run(smol, prompts, drafter, batch=2, params=params)
    assert [o.token_ids for o in good] == [p.token_ids[:32] for p in plain[:4]]
    broken = _run(smol, prompts, drafter, batch=2, params=params, ablate=[piece])
    assert [o.token_ids for o in broken] != [o.token_ids for o in good]


def test_stops_inside_an_accepted_run(smol, smol_prompts, plain) -> None:
    model, tok = smol
    i = 0
    ref = plain[i].token_ids
    prompts = smol_prompts[i : i + 1]
    oracle = OracleDrafter({0: ref}, {0: len(prompts[0])})
    spec = SpecConfig(max_nodes=8, max_depth=8)
    # token limit in the middle of an 8-token accepted run
    out = _run(smol, prompts, oracle, 1, SamplingParams(max_new_tokens=13), spec=spec)[0]
    assert out.token_ids == ref[:13] and out.finish_reason == "length" and out.steps == 2
    # a stop string completed by a token in the middle of a run: nothing after it is emitted
    text = tok.decode(ref[:20], skip_special_tokens=True)
    stop = text[-6:].strip() or text[-8:]
    out = _run(smol, prompts, oracle, 1, SamplingParams(max_new_tokens=NEW, stop=(stop,)), spec=spec)[0]
    k = next(k for k in range(1, NEW + 1) if stop in tok.decode(ref[:k], skip_special_tokens=True))
    assert out.token_ids == ref[:k] and out.finish_reason == "stop"
    assert stop not in out.text and tok.decode(ref[:k], skip_special_tokens=True).startswith(out.text)
    # EOS inside a run: the drafted continuation goes on past EOS, the output must not
    eos = tok.eos_token_id
    fake = ref[:10] + [eos] + ref[10:]
    oracle_eos = OracleDrafter({0: fake}, {0: len(prompts[0])})
    out = _run(smol, prompts, oracle_eos, 1, spec=spec)[0]
    assert out.token_ids[-1] == eos or out.token_ids == ref[: len(out.token_ids)]
    assert eos not in out.token_ids[:-1]
