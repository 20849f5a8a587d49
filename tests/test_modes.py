"""Tree modes (``chain`` / ``static`` / ``dyntree``, and the adaptive controller) are lossless.

Real model (SmolLM2-135M-Instruct, fp32): greedy output of every mode equals plain greedy decoding
token for token on 8 Spec-Bench prompts x 48 new tokens at batch size 4, and every mode really
speculated. Fast unit tests cover the n-gram drafter's ``expand`` (the builder's candidates).
"""

from __future__ import annotations

import json
import math
import time

import pytest

from dyntree.common.builder import PartialTree, TreeBuilder
from dyntree.common.config import SamplingParams, SpecConfig
from dyntree.common.cost_model import CostModel
from dyntree.common.drafter import DraftRequest
from dyntree.common.drafters import make_drafter
from dyntree.common.speculator import Speculator
from dyntree.standalone.engine import SpecEngine
from dyntree.standalone.target import make_hf_drafter

NEW = 48


def _req(tokens: list[int]) -> DraftRequest:
    return DraftRequest("r", tokens, max_nodes=8, max_depth=4)


def _cands(drafter, tokens, frontier, partial, k=8, shaping=None):
    c = drafter.expand([_req(tokens)], [frontier], [partial], k, shaping)
    return {int(i): float(p) for i, p in zip(c.ids[0], c.probs[0]) if p > 0}, float(c.entropy[0])


def test_ngram_expand_distribution_follows_earlier_continuations() -> None:
    drafter = make_drafter("ngram:min_n=1,max_n=2")
    # "5 6" was followed by 7 twice and by 9 once; "6" alone by 7, 7, 9
    tokens = [5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 9, 3, 5, 6]
    root = PartialTree([6], [-1], [0])
    probs, ent = _cands(drafter, tokens, [0], root)
    # suffix (5, 6) matched 3 times, each 2 tokens long (the token before differs: 1, 2 vs 3);
    # suffix (6,) adds nothing new (same positions). Shares 2/3, 1/3, scaled by L/(L+1) = 2/3
    assert probs == pytest.approx({7: 2 / 3 * 2 / 3, 9: 1 / 3 * 2 / 3})
    assert ent == pytest.approx(-(2 / 3) * math.log(2 / 3) - (1 / 3) * math.log(1 / 3), rel=1e-5)
    assert _cands(drafter, tokens, [0], root, k=1)[0] == pytest.approx({7: 4 / 9})  # top-k: most likely first
    # sampling shapes the shares like logits: temperature 0.5 squares them before renormalising
    hot, _ = _cands(drafter, tokens, [0], root, shaping=SamplingParams(temperature=0.5))
    assert hot == pytest.approx({7: 0.8 * 2 / 3, 9: 0.2 * 2 / 3})
    # after drafting 7 the context ends "6 7": followed by 1 and 2
    grown = PartialTree([6, 7], [-1, 0], [0, 1])
    assert set(_cands(drafter, tokens, [1], grown)[0]) == {1, 2}
    # an unseen context gives no candidates: no children
    lost = PartialTree([6, 11], [-1, 0], [0, 1])
    assert _cands(drafter, tokens, [1], lost) == ({}, 0.0)


def test_ngram_weights_by_match_length() -> None:
    drafter = make_drafter("ngram:min_n=1,max_n=2")
    # the context ends "1 2 3 4": an old passage "1 2 3 4 -> 8" agrees 4 tokens back, a recent
    # "3 4 -> 9" only 2 (the key length): weights 4 and 2
    tokens = [1, 2, 3, 4, 8, 0, 7, 3, 4, 9, 0, 1, 2, 3, 4]
    root = PartialTree([4], [-1], [0])
    probs, _ = _cands(drafter, tokens, [0], root)
    assert probs == pytest.approx({8: 4 / 6 * 4 / 5, 9: 2 / 6 * 4 / 5})
    # drafting along the copied passage keeps its full length: after "8" only it continues, 5 long
    grown = PartialTree([4, 8], [-1, 0], [0, 1])
    assert _cands(drafter, tokens, [1], grown)[0] == pytest.approx({0: 5 / 6})
    # a single continuation after a one-token match is less sure than after a long one
    short, _ = _cands(drafter, [5, 6, 1, 5], [0], PartialTree([5], [-1], [0]))
    assert short == pytest.approx({6: 1 / 2})
    # the own trie ranks by the same weights: the copied passage's branch comes first
    tree = drafter.propose([DraftRequest("t", tokens, max_nodes=1, max_depth=1)])[0]
    assert tree.tokens.tolist() == [4, 8]


def test_ngram_expand_drives_every_builder_mode() -> None:
    drafter = make_drafter("ngram")
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 9, 1, 2, 3, 4, 9, 1, 2]
    req = DraftRequest("r", tokens, max_nodes=6, max_depth=4)

    def expand(frontiers, partials, k):
        return drafter.expand([req], frontiers, partials, k, None).split([len(f) for f in frontiers])

    # every match is offered to the dynamic tree: the speculator's builder gets the drafter's limit
    assert drafter.candidates_per_node == 8
    sp = Speculator(make_drafter("ngram:max_matches=5"), SpecConfig(tree="dyntree"), vocab_size=16)
    assert sp.builder.candidates_per_node == 5
    for mode in ("chain", "static", "dyntree", "beam"):
        tree = TreeBuilder().build_batch([2], expand, budgets=[(6, 4)], mode=mode, vocab_size=16)[0]
        assert tree.tokens[1].item() == 3  # "1 2" is always followed by 3
        assert 1 < tree.size <= 7 and tree.max_depth <= 4
    branchy = TreeBuilder().build_batch([2], expand, budgets=[(6, 4)], mode="dyntree")[0]
    assert sorted(branchy.tokens[branchy.parents == 1].tolist()) == [4, 5]  # after 3: 4 or 5
    with pytest.raises(ValueError, match=r"candidate token ids must lie in \[0, 4\)"):
        TreeBuilder().build_batch([2], expand, budgets=[(6, 4)], mode="chain", vocab_size=4)


def _run(smol, prompts, spec: SpecConfig, batch: int = 4, cost: CostModel | None = None):
    model, tok = smol
    drafter = make_hf_drafter(spec.drafter, model, tok)
    eng = SpecEngine(model, tok, drafter, spec, cost_model=cost)
    outs = []
    for i in range(0, len(prompts), batch):
        ids = list(range(i, min(i + batch, len(prompts))))
        outs += eng.generate(prompts[i : i + batch], SamplingParams(max_new_tokens=NEW), request_ids=ids)
    return outs


@pytest.fixture(scope="module")
def prompts8(smol_prompts):
    return smol_prompts[::2][:8]


@pytest.fixture(scope="module")
def plain8(smol, prompts8):
    return [o.token_ids for o in _run(smol, prompts8, SpecConfig(drafter="none"))]


@pytest.mark.slow
@pytest.mark.parametrize(
    "tree, adaptive", [("chain", False), ("static", False), ("dyntree", False), ("dyntree", True)]
)
def test_modes_equal_plain_greedy_on_real_model(smol, prompts8, plain8, tree: str, adaptive: bool) -> None:
    # adaptive: a cost model under which speculation pays, so the controller really drafts
    # lr 0 and no outcome check: a frozen verify-cost model, so this machine's speed cannot talk the
    # controller out of it; the throughput objective: each batch here has nothing waiting, and the
    # batch objective (rightly) drafts nothing while one request without an n-gram match sets the pace
    spec = SpecConfig(drafter="ngram", max_nodes=16, max_depth=6, tree=tree, adaptive=adaptive,
                      controller={"outcome_ema": 0.0, "objective": "throughput"})
    cost = CostModel({1: 60.0, 128: 70.0, 2048: 400.0}, lr=0.0) if adaptive else None
    outs = _run(smol, prompts8, spec, cost=cost)
    mismatched = [i for i, (o, ref) in enumerate(zip(outs, plain8)) if o.token_ids != ref]
    assert not mismatched, f"{tree} (adaptive={adaptive}): prompts {mismatched} differ from plain greedy"
    assert sum(o.draft_nodes for o in outs) > 0
    assert sum(o.step_tokens for o in outs) / sum(o.steps for o in outs) > 1.05  # it speculated
    if tree != "chain":
        assert max(o.draft_nodes / o.steps for o in outs) > 1.0  # trees, not just single drafts


@pytest.mark.slow
def test_bench_runs_every_mode_with_overhead_fields() -> None:
    from transformers import AutoTokenizer

    from spec_support import tiny_llama
    from dyntree.models import model_path
    from dyntree.standalone.bench import HF_MODES, MODES, compare, mode_spec, run_hf_mode, run_mode
    from test_engine_tiny import _prompts

    tok = AutoTokenizer.from_pretrained(model_path("smollm2"))
    model = tiny_llama(2)
    prompts = _prompts(2, 2)
    ids = [0, 1]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    spec = SpecConfig(drafter="ngram", max_nodes=8, max_depth=4, adaptive=True, controller={"outcome_ema": 0.0})
    # Frozen (no outcome check either) and verify-dominated: the drafting cost the controller learns
    # online from this machine's clock (ngram + dyntree builder: several ms on a slow CI box) must not
    # make speculation look unprofitable.
    flat = CostModel({1: 1000.0, 64: 1010.0}, lr=0.0)
    base = run_mode(model, tok, prompts, ids, "none", spec, params, 2, flat)
    assert base["tau"] == 1.0 and base["adaptive"] is False and base["max_nodes"] == 0
    for mode in [m for m in MODES[1:] if m not in HF_MODES]:
        run = run_mode(model, tok, prompts, ids, mode, spec, params, 2, flat)
        compare(base, run)
        assert run["mode"] == mode and run["tree"] == (None if mode == "own" else mode) and run["adaptive"]
        assert run["identical_to_none"] == 1.0 and run["speedup"] is not None
        # decoding alone: the prefills and the first token of each request taken out (wall_s and
        # prefill_s are rounded to 1 ms, a few % of this tiny model's run)
        assert run["decode_tokens_per_s"] == pytest.approx(
            (run["tokens"] - len(ids)) / (run["wall_s"] - run["prefill_s"]), rel=0.05)
        assert run["decode_speedup"] == pytest.approx(run["decode_tokens_per_s"] / base["decode_tokens_per_s"], rel=1e-3)
        assert run["tau"] > 1.0 and run["accepted_per_depth"] and run["accepted_per_depth"][0] > 0
        assert 0 <= run["draft_ms_per_step"] <= run["step_ms"] and run["engine_steps"] > 0
        if mode == "own":  # no builder: the n-gram drafter shapes its own trees
            assert run["build_ms_per_step"] is None and run["build_pct_of_step"] is None
        else:
            assert 0 <= run["build_ms_per_step"] <= run["draft_ms_per_step"]
            assert 0 <= run["build_pct_of_step"] <= 100
    with pytest.raises(ValueError, match="unknown engine mode 'tree'"):
        mode_spec("tree", spec)
    # transformers' own generate and its prompt lookup, on the same model: the same greedy tokens
    greedy = SamplingParams(max_new_tokens=24)
    base = run_mode(model, tok, prompts, ids, "none", spec, greedy, 1, flat)
    for mode in HF_MODES:
        run = run_hf_mode(model, tok, prompts, ids, mode, greedy)
        compare(base, run)
        assert run["identical_to_none"] == 1.0 and run["tau"] is None and run["tokens"] == base["tokens"]
        assert run["decode_speedup"] is None  # transformers' prefill is not timed apart
    with pytest.raises(ValueError, match="greedy"):
        run_hf_mode(model, tok, prompts, ids, "hf", SamplingParams(temperature=0.7))


def test_bench_runs_several_drafters_round_by_round() -> None:
    from transformers import AutoTokenizer

    from spec_support import tiny_llama
    from dyntree.models import model_path
    from dyntree.standalone.bench import Prompt, _median_run, run_bench

    tok = AutoTokenizer.from_pretrained(model_path("smollm2"))
    prompts = [Prompt(0, "one two three one two three one two"), Prompt(1, "a b c a b c a b c")]
    spec = SpecConfig(drafter="ngram", max_nodes=4, max_depth=4)
    doc = run_bench(tiny_llama(2), tok, prompts, ["none", "own"], ["ngram", "ngram:max_n=2"], spec,
                    SamplingParams(max_new_tokens=12, ignore_eos=True), 2, False, "tiny", "fp32", repeats=3)
    assert doc["repeats"] == 3 and doc["drafters"] == ["ngram", "ngram:max_n=2"]
    assert [(r["mode"], r["drafter"]) for r in doc["runs"]] == [("none", "none"), ("own", "ngram"), ("own", "ngram:max_n=2")]
    for run in doc["runs"]:
        assert len(run["tokens_per_s_runs"]) == 3 and len(run["speedup_runs"]) == 3
        assert run["tokens_per_s"] == sorted(run["tokens_per_s_runs"])[1]  # the median run
        assert run["speedup"] == pytest.approx(sorted(run["speedup_runs"])[1], abs=1e-4)
        assert run["decode_speedup"] == pytest.approx(sorted(run["decode_speedup_runs"])[1], abs=1e-4)
        assert run["identical_to_none"] == 1.0
    # the median run's own record, every round's speed, the median of the per-round speedups
    rounds = [{"tokens_per_s": t, "speedup": s, "decode_speedup": ds, "identical_to_none": i, "tau": tau}
              for t, s, ds, i, tau in [(10.0, 1.2, 1.3, 1.0, 1.5), (30.0, 0.9, 0.8, 0.5, 1.7), (20.0, 1.0, 1.4, 1.0, 1.6)]]
    run = _median_run(rounds)
    assert run["tau"] == 1.6 and run["tokens_per_s_runs"] == [10.0, 30.0, 20.0]
    assert run["speedup"] == 1.0 and run["identical_to_none"] == 0.5
    assert run["decode_speedup"] == 1.3 and run["decode_speedup_runs"] == [1.3, 0.8, 1.4]


def test_lockstep_runs_equal_separate_runs_and_time_their_own_steps(monkeypatch) -> None:
    """``run_lockstep`` interleaves the jobs one unit at a time (rotating who goes first), each
    job's outputs and steps are those of a run of its own, and each is timed by its own units."""
    from transformers import AutoTokenizer

    from spec_support import tiny_llama
    from dyntree.models import model_path
    from dyntree.standalone import bench
    from dyntree.standalone.engine import SpecEngine
    from test_engine_tiny import _prompts

    tok = AutoTokenizer.from_pretrained(model_path("smollm2"))
    model = tiny_llama(2)
    prompts, ids = _prompts(2, 3), [0, 1, 2]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    spec = SpecConfig(drafter="ngram", max_nodes=6, max_depth=4)
    jobs = [("none", spec), ("own", spec), ("dyntree", spec)]
    alone = [bench.run_mode(model, tok, prompts, ids, m, s, params, 2) for m, s in jobs]

    order: list[int] = []  # the engine of each unit (a prefill or a step ends in one _retire)
    started: set[int] = set()  # engines past their warm-up
    retire, stepwise = SpecEngine._retire, SpecEngine.stepwise

    def spy_retire(self, *a, **k):
        if id(self) in started:
            order.append(id(self))
        return retire(self, *a, **k)

    def spy_stepwise(self, prompts, params, request_ids, *a, **k):
        if request_ids != ["warm-up"]:
            started.add(id(self))
        return stepwise(self, prompts, params, request_ids, *a, **k)

    monkeypatch.setattr(SpecEngine, "_retire", spy_retire)
    monkeypatch.setattr(SpecEngine, "stepwise", spy_stepwise)
    t0 = time.perf_counter()
    runs = bench.run_lockstep(model, tok, prompts, ids, jobs, params, 2)
    total = time.perf_counter() - t0
    for a, r in zip(alone, runs):
        assert [o["token_ids"] for o in r["outputs"]] == [o["token_ids"] for o in a["outputs"]]
        assert r["engine_steps"] == a["engine_steps"] and r["mode"] == a["mode"]
    assert runs[0]["tau"] == 1.0 and runs[1]["tau"] > 1.0
    # one unit each in turn: no engine takes two steps in a row while the others still run, and
    # the first engine of a cycle changes from cycle to cycle
    engines = list(dict.fromkeys(order))
    assert len(engines) == 3
    shortest = min(order.count(e) for e in engines)
    head = order[: 3 * (shortest - 1)]
    assert all(head[i] != head[i + 1] for i in range(len(head) - 1))
    assert len({head[i] for i in range(0, len(head), 3)}) > 1
    # each job is timed by its own units: together they fill the run, none of them alone does
    walls = [r["wall_s"] for r in runs]
    assert max(walls) < 0.9 * total and sum(walls) <= total + 0.01


def _benchmark_script(name: str):
    """``benchmarks/<name>.py`` as a module (a script, not part of the package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec_ = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(mod)
    return mod


def test_modes_eval_runs_dyntree_once_per_threshold() -> None:
    mod = _benchmark_script("modes_eval")
    base = SpecConfig(drafter="ngram", max_nodes=16, max_depth=8, tree_options={"max_children": 6})
    runs = mod.variants(["chain", "dyntree"], base, [0.02, 0.0])
    assert [(m, s.tree_options.threshold) for m, s in runs] == [("chain", 0.02), ("dyntree", 0.02), ("dyntree", 0.0)]
    assert all(s.max_nodes == 16 and s.max_depth == 8 and s.tree_options.max_children == 6 for _, s in runs)
    assert [s.tree_options.threshold for _, s in mod.variants(["dyntree"], base, [])] == [base.tree_options.threshold]
    wide = mod.variants(["static", "dyntree"], base, [0.0], max_children=8)
    assert [(m, s.tree_options.max_children) for m, s in wide] == [("static", 6), ("dyntree", 8)]
    with pytest.raises(ValueError, match="threshold"):
        mod.variants(["dyntree"], base, [1.5])
    from dyntree.standalone.bench import Prompt

    prompts = [Prompt(i, "q", c) for i, c in enumerate(["coding", "writing", "qa", "coding"])]
    assert [p.id for p in mod.select(prompts, "coding")] == [0, 3]
    assert [p.id for p in mod.select(prompts, "mt_bench")] == [0, 1, 3]
    assert len(mod.select(prompts, "")) == 4
    with pytest.raises(SystemExit, match="rag"):
        mod.select(prompts, "rag")
    runs = [{"drafter": "hydra", "max_nodes": 16, "mode": m, "tau": t, "threshold": thr}
            for m, t, thr in [("chain", 1.5, None), ("static", 2.0, None), ("dyntree", 2.3, 0.0), ("dyntree", 2.1, 0.02)]]
    lines = mod.summarize(runs)
    assert len(lines) == 2 and "1.150x" in lines[0] and "(static 2.000)" in lines[0] and lines[0].endswith("met")
    assert lines[1].endswith("not met")
    # groups: each reported apart, a prompt may sit in two; tau per group from each prompt's steps
    groups = mod.pick_groups(prompts, "coding:1,mt_bench:3")
    assert {g: [p.id for p in ps] for g, ps in groups.items()} == {"coding": [0], "mt_bench": [0, 1, 3]}
    for bad in ("coding", "coding:0", "coding:1,coding:2"):
        with pytest.raises(SystemExit, match="CATEGORY:N"):
            mod.pick_groups(prompts, bad)
    from dyntree.standalone.bench import tau_by_group
    from dyntree.standalone.engine import RequestOutput

    members = {"coding": {0, 3}, "mt_bench": {0, 1, 3}}
    outs = [RequestOutput(0, [7], [1] * 9, steps=4), RequestOutput(1, [7], [1] * 5, steps=4),
            RequestOutput(3, [7], [1] * 5, steps=2)]
    assert tau_by_group(outs, members) == {"coding": 2.0, "mt_bench": 1.6}
    runs = [{"drafter": "hydra", "max_nodes": 16, "mode": m, "tau": 0.0, "threshold": thr, "by_category": g}
            for m, thr, g in [("static", None, {"coding": 2.4, "mt_bench": 2.0}),
                              ("dyntree", 0.0, {"coding": 2.7, "mt_bench": 2.1})]]
    lines = mod.summarize(runs)
    assert [line.split(": ", 1)[0] for line in lines] == ["hydra N=16 dyntree thr=0.0 [coding]"] * 2 + [
        "hydra N=16 dyntree thr=0.0 [mt_bench]"] * 2
    assert lines[0].endswith("1.125x the best fixed shape (static 2.400); target >= 1.10x: met")
    assert lines[1].endswith("tau 2.700; target >= 2.5: met") and lines[3].endswith("target >= 2.2: not met")


def test_vllm_bench_fresh_engines_replace_the_old_ones(monkeypatch) -> None:
    """``--fresh-engines``: each round's engines are built anew in the build order, every old one
    (the spare plain engine too) shut down first; refused with every engine in one process."""
    mod = _benchmark_script("vllm_bench")
    built: list[str] = []

    class Fake:
        def __init__(self, config: str) -> None:
            self.config, self.down = config, False
            core = type("Core", (), {"shutdown": lambda _: setattr(self, "down", True)})()
            self.llm_engine = type("Engine", (), {"engine_core": core})()

    monkeypatch.setattr(mod, "_engine", lambda c, dtype, sets: built.append(c) or Fake(c))
    engines: dict = {}
    mod._build_engines(engines, ["none", "dyntree"], "float32", {})
    first = dict(engines)
    mod._build_engines(engines, ["none", "dyntree"], "float32", {})
    assert built == ["none", "dyntree", "none", "dyntree"]
    assert all(e.down for e in first.values()) and not any(e.down for e in engines.values())
    assert all(engines[c] is not first[c] for c in first)
    # a spare plain engine first, never handed a config's calls, shut down with the rest
    built.clear()
    mod._build_engines(engines, ["dyntree", "none"], "float32", {}, spare=True)
    spare = engines[mod.SPARE]
    assert built == ["none", "dyntree", "none"] and list(engines) == [mod.SPARE, "dyntree", "none"]
    assert engines["none"] is not spare and not spare.down
    mod._build_engines(engines, ["none"], "float32", {})
    assert spare.down and mod.SPARE not in engines
    with pytest.raises(ValueError, match="in_process"):
        mod.interleaved(["none"], "float32", 8, 1, (1,), in_process=True, fresh=True)


def test_vllm_bench_warm_up_runs_every_call_on_each_new_engine(monkeypatch) -> None:
    """``--warm-up``: each new engine runs the given calls once before it is used, and their
    tokens/s are kept per config and build (``first_calls``)."""
    mod = _benchmark_script("vllm_bench")
    ran: list[tuple[str, list[str]]] = []
    out = type("Out", (), {"token_ids": [1, 2, 3]})()

    class Fake:
        def __init__(self, config: str) -> None:
            self.config = config
            self.llm_engine = type("Engine", (), {"engine_core": type("Core", (), {"shutdown": lambda _: None})(),
                                                  "logger_manager": type("Loggers", (), {"stat_loggers": []})()})()

        def generate(self, prompts: list[str], params: object, use_tqdm: bool) -> list:
            ran.append((self.config, prompts))
            return [type("Res", (), {"outputs": [out]})() for _ in prompts]

        def collective_rpc(self, method, args=()) -> list:
            return [[]]

    monkeypatch.setattr(mod, "_engine", lambda c, dtype, sets: Fake(c))
    engines: dict = {}
    first: dict = {}
    warm = [["a"], ["b", "c"]]
    for _ in range(2):
        mod._build_engines(engines, ["none", "dyntree"], "float32", {}, warm, None, first)
    assert ran == [(c, p) for c in ("none", "dyntree") for p in warm] * 2
    assert sorted(first) == ["dyntree", "none"] and all(len(v) == 2 and all(len(r) == 2 and min(r) > 0 for r in v)
                                                        for v in first.values())


def test_vllm_bench_times_each_engines_forwards_and_its_plain_steps() -> None:
    """Each engine's worker times its model forwards (installed once); a call's record sums them
    and takes the median of its plain steps at the full batch (every request one query token),
    not verify steps, prefill chunks or steps after a request finished."""
    import torch

    mod = _benchmark_script("vllm_bench")

    class Runner:
        def __init__(self) -> None:
            self.input_batch = type("Batch", (), {"num_reqs": 0})()
            self.ms: dict[int, float] = {}

        def _model_forward(self, input_ids=None, positions=None) -> str:
            time.sleep(self.ms[int(input_ids.shape[0])] / 1e3)
            return "hidden"

    worker = type("Worker", (), {"model_runner": Runner()})()

    class Fake:
        def __init__(self, steps: list[tuple[int, int, float]]) -> None:
            self.steps = steps
            self.llm_engine = type("Engine", (), {"logger_manager": type("Loggers", (), {"stat_loggers": []})()})()

        def collective_rpc(self, method, args=()) -> list:
            return [method(worker, *args)]

        def generate(self, prompts: list[str], params: object, use_tqdm: bool) -> list:
            runner = worker.model_runner
            for reqs, tokens, ms in self.steps:
                runner.input_batch.num_reqs, runner.ms[tokens] = reqs, ms
                assert runner._model_forward(input_ids=torch.zeros(tokens), positions=None) == "hidden"
            out = type("Out", (), {"token_ids": [1]})()
            return [type("Res", (), {"outputs": [out]})() for _ in prompts]

    # a prefill chunk, three plain steps of 4, a verify of 4 requests, a plain step of 3
    llm = Fake([(4, 40, 50.0), (4, 4, 10.0), (4, 4, 12.0), (4, 4, 11.0), (4, 9, 50.0), (3, 3, 50.0)])
    mod._time_forwards(llm)
    mod._time_forwards(llm)  # installed once: each forward is timed once
    worker.model_runner._bench_forwards.append((4, 4, 99.0))  # before the call: not its own
    cell = mod._Cell()
    cell.run(llm, ["a", "b", "c", "d"], None)
    res = cell.result()
    assert 0.183 <= res["forward_s"] < 0.3
    assert len(cell.plain_forwards) == 3
    assert 11.0 <= res["plain_forward_ms"] < 13.0  # the median of 10, 11 and 12 ms (sleeps run over)
    empty = mod._Cell()  # a cell without plain steps reads none
    empty.tokens, empty.wall = 1, 1.0
    assert empty.result()["plain_forward_ms"] is None


def test_vllm_bench_warm_up_passes_repeat_every_call_of_the_run() -> None:
    """``--warm-up N``: a new engine's untimed calls are every call of the run (each cell's
    batches in order), N times over; none without warm-up."""
    mod = _benchmark_script("vllm_bench")
    sets = {"chat": [f"c{i}" for i in range(8)], "code": [f"k{i}" for i in range(8)]}
    once = mod.warm_calls(sets, (8, 16), 1)
    assert once == [sets["chat"], sets["code"], sets["chat"] + sets["code"]]
    assert mod.warm_calls(sets, (8, 16), 3) == once * 3
    assert mod.warm_calls(sets, (1,), 1) == [[p] for p in sets["chat"] + sets["code"]]
    assert mod.warm_calls(sets, (8, 16), 0) == []


def test_vllm_bench_fresh_engines_rotate_the_build_order() -> None:
    """Plain decoding's engines are built first and vLLM's n-gram last; with fresh engines each
    round starts one config further on, so no config is always built first."""
    mod = _benchmark_script("vllm_bench")
    configs = ["vllm_ngram", "dyntree", "none", "none_sync"]
    assert mod.build_order(configs, 0) == mod.build_order(configs, 3) == ["none", "none_sync", "dyntree", "vllm_ngram"]
    firsts = [mod.build_order(configs, r, fresh=True)[0] for r in range(4)]
    assert firsts == ["none", "none_sync", "dyntree", "vllm_ngram"]
    assert mod.build_order(configs, 5, fresh=True) == ["none_sync", "dyntree", "vllm_ngram", "none"]


def test_vllm_bench_pools_every_call_over_the_plain_engines_of_its_round() -> None:
    """The pooled ratio is each call's tokens/s over the plain engines' in the same cell and round
    (a slow round hits them all), the geometric mean over calls with a bootstrap interval; the
    A/A control (``none_sync``) is read over ``none`` alone."""
    mod = _benchmark_script("vllm_bench")
    rounds = {"chat/b8": [40.0, 30.0, 50.0], "chat+code/b16": [70.0, 60.0, 80.0]}
    cfg = lambda scale: {cell: {"tokens_per_s": [t * s for t, s in zip(tps, scale)]} for cell, tps in rounds.items()}  # noqa: E731
    configs = {"none": cfg([1.0, 1.0, 1.0]), "none_sync": cfg([1.02, 1.02, 1.02]), "slow": cfg([0.9, 0.9, 0.9]),
               "noisy": cfg([0.8, 1.0, 1.1])}
    res = mod.pooled(configs)
    assert set(res) == {"none_sync", "slow", "noisy"}
    assert res["none_sync"]["ratio"] == pytest.approx(1.02) and res["none_sync"]["over"] == "none"
    assert res["slow"]["ratio"] == pytest.approx(0.9 / 1.01, rel=1e-3) and res["slow"]["calls"] == 6
    assert res["slow"]["ci95"] == pytest.approx([0.9 / 1.01] * 2, rel=1e-3)  # no spread, no interval
    lo, hi = res["noisy"]["ci95"]
    assert lo < res["noisy"]["ratio"] < hi and lo < 0.9 and hi > 1.0
    assert mod.pooled({"x": configs["slow"]}) == {}  # nothing to pool over without plain decoding
    del configs["none_sync"]
    assert mod.pooled(configs)["slow"] == {"ratio": 0.9, "ci95": [0.9, 0.9], "calls": 6, "over": "none"}


def test_vllm_bench_brackets_every_call_with_plain_decoding() -> None:
    """With ``--bracket`` plain decoding runs first and after every other config, rotated by the
    call (and which plain call counts with it); each call is then read over the plain calls right
    before and after it, so a machine that slows down steadily through a slot cancels, where the
    slot's counted plain call alone would not."""
    mod = _benchmark_script("vllm_bench")
    configs = ["none", "none_sync", "a", "b"]
    assert mod.call_order(configs, 2) == [(c, True) for c in ("none_sync", "a", "b", "none")]
    assert mod.call_order(configs, 1) == [(c, True) for c in ("b", "a", "none_sync", "none")]  # odd: reversed
    order = mod.call_order(configs, 1, bracket=True)
    assert order == [("none", False), ("b", True), ("none", True), ("a", True), ("none", False),
                     ("none_sync", True), ("none", False)]
    # a config has other neighbours from one call to the next
    assert [[c for c, _ in mod.call_order(configs, s, bracket=True)][1::2] for s in range(4)] == [
        ["none_sync", "a", "b"], ["b", "a", "none_sync"], ["a", "b", "none_sync"], ["none_sync", "b", "a"]]
    # and over 2 n calls of n configs each takes every place twice
    many = [f"c{i}" for i in range(5)]
    places = [[c for c, _ in mod.call_order(many, s)].index("c0") for s in range(10)]
    assert sorted(places) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    # the plain call that counts in the round's tally moves with the call, as the others do
    assert [[j for j, x in enumerate(mod.call_order(configs, s, bracket=True)) if x == ("none", True)]
            for s in range(4)] == [[0], [2], [4], [6]]
    assert [mod.call_order(["a", "b"], s, bracket=True) for s in range(3)] == [  # nothing to bracket with
        [("a", True), ("b", True)], [("b", True), ("a", True)], [("b", True), ("a", True)]]
    # one slot through which the machine slows by a tenth a call
    speed = {j: 1 - 0.1 * j for j in range(len(order))}
    own = {"none": 1.0, "none_sync": 1.0, "a": 0.9, "b": 1.2}
    calls = [{"round": 0, "cell": "chat/b8", "chunk": 0, "config": c, "counted": k, "start_s": float(j),
              "tokens": 100, "wall_s": 100 / (50 * own[c] * speed[j])} for j, (c, k) in enumerate(order)]
    res = mod.bracketed(calls[::-1])  # records in any order: read by start time
    assert res["a"]["ratio"] == pytest.approx(0.9) and res["b"]["ratio"] == pytest.approx(1.2)
    assert res["none_sync"]["ratio"] == pytest.approx(1.0) and res["a"]["calls"] == 1
    assert res["b"]["cells"] == {"chat/b8": pytest.approx(1.2)}
    assert "none" not in res
    # over the slot's counted plain call alone (the third call) "b" (the second) reads 1.2 x 0.9 / 0.8
    counted = next(x for x in calls if x["config"] == "none" and x["counted"])
    b = next(x for x in calls if x["config"] == "b")
    assert (b["tokens"] / b["wall_s"]) / (counted["tokens"] / counted["wall_s"]) == pytest.approx(1.2 * 0.9 / 0.8)


def test_vllm_runs_reads_each_call_over_its_own_runs_plain_neighbours_and_pools_only_like_runs(tmp_path) -> None:
    """Pooled runs read every call over the plain calls around it in its own run: two runs whose
    slots share round, cell and chunk (and start times) are not merged, so a run on a faster
    spell of the machine does not become the other's neighbours. Runs that differ in what they
    measured, or in the dyntree code, are refused by field; a run that is not bracketed, or names
    no code outside git history, is refused when read."""
    mod = _benchmark_script("vllm_runs")

    def run(source: str, plain: float, own: float, code: str = "tree", starts=(0.0, 1.0, 2.0), **fields) -> dict:
        calls = [{"round": 0, "cell": "chat/b8", "chunk": 0, "config": c, "counted": True, "start_s": start,
                  "tokens": 100, "wall_s": 100 / (50 * speed)}
                 for start, (c, speed) in zip(starts, [("none", plain), ("a", plain * own), ("none", plain)])]
        return {**{key: "same" for key in mod.SAME}, **fields, "calls": calls, "bracketed": {}, "source": source,
                "code": {"dyntree_tree": code, "modified": False}, "date": "d", "rounds": 1, "mode": "m"}

    # the second run's calls fall between the first's: merged, each "a" would read the other run's plain calls
    doc = mod.pool([run("r1", 1.0, 0.9), run("r2", 2.0, 0.8, starts=(0.5, 2.1, 3.0))])
    assert doc["bracketed"]["a"]["ratio"] == pytest.approx(0.72 ** 0.5, abs=1e-4) and doc["bracketed"]["a"]["calls"] == 2
    assert [r["source"] for r in doc["runs"]] == ["r1", "r2"] and doc["code"] == "tree"
    with pytest.raises(ValueError, match="differ in 'dtype'"):
        mod.pool([run("r1", 1.0, 0.9), run("r2", 1.0, 0.9, dtype="fp32")])
    with pytest.raises(ValueError, match="different dyntree code"):
        mod.pool([run("r1", 1.0, 0.9), run("r2", 1.0, 0.9, code="other")])
    unbracketed, nameless = tmp_path / "plain.json", tmp_path / "nameless.json"
    unbracketed.write_text(json.dumps({"configs": {}}))
    nameless.write_text(json.dumps({k: v for k, v in run("r", 1.0, 0.9).items() if k != "code"}))
    with pytest.raises(SystemExit, match="not a bracketed run"):
        mod.load(str(unbracketed))
    with pytest.raises(SystemExit, match="pass it as REV:PATH"):
        mod.load(str(nameless))


def test_vllm_step_profile_takes_each_numbers_median_over_rounds_and_shares_of_the_median_step() -> None:
    mod = _benchmark_script("vllm_step_profile")

    def run(step: float, forward: float, drafting: float, plan: float | None) -> dict:
        phases = {"vllm_forward": forward, "tree_attention": 1.0, "lm_head": 2.0, "drafting": drafting}
        return {"steps": 10, "tokens_per_s": 1e3 / step, "step_ms": step, "query_rows_per_step": 3.0,
                "phases_ms": phases, "drafting_ms": {} if plan is None else {"plan": plan, "rest": drafting - plan}}

    # the round without drafting pieces counts as 0 for each of them; the step's shares come from the medians
    res = mod._median([run(40.0, 26.0, 5.0, None), run(30.0, 20.0, 3.0, 1.0), run(34.0, 22.0, 4.0, 2.0)])
    assert res["rounds"] == 3 and len(res["per_round"]) == 3
    assert res["step_ms"] == 34.0 and res["phases_ms"]["vllm_forward"] == 22.0 and res["phases_ms"]["drafting"] == 4.0
    assert res["drafting_ms"] == {"plan": 1.0, "rest": 2.0}
    assert res["share_outside_vllm_forward"] == pytest.approx(round(1 - 22 / 34, 4))
    assert res["share_outside_forward_and_lm_head"] == pytest.approx(round(1 - 24 / 34, 4))
    assert res["share_drafting_and_tree_attention"] == pytest.approx(round(5 / 34, 4))
