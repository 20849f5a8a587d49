"""The SGLang plugin on CPU (sglang 0.5.23 installed without its CUDA dependencies).

* registration through the ``sglang.srt.plugins`` entry point, in this process and in a spawned
  child; conformance of the spec class with every method of the installed
  ``SpeculativeAlgorithm``; version refusal;
* flags and the options file -> one validated config, and each start-up refusal naming its flag;
  SGLang's own ``prepare_server_args`` + ``resolve_once`` with ``--speculative-algorithm dyntree``;
* the worker (:class:`~dyntree.sglang_plugin.worker.DynTreeWorker`) driven like SGLang's
  synchronous scheduler against a stand-in target with SmolLM2's real weights over a token pool
  (``tests/sglang_standin.py``): greedy outputs identical to plain decoding on 8 Spec-Bench
  prompts x 32 tokens for n-gram and Hydra, FULL and QLEN mask layouts, chunked prefill; each
  ablation (no tree mask, no depth positions, no KV move) diverges; sampled (temperature, top-p)
  Hydra trees keep the target's distribution of a verified token (chi-square over 256 requests).

SGLang's worker modules import only with a torchvision stub (``tests/sglang_stub``), so those
runs happen in child processes. Without SGLang installed these tests skip, except under CI.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dyntree.common.drafters.hydra import SHIPPED_HEADS
from dyntree.sglang_plugin.options import (ENV, INT4_DRAFT, OptionsError, request_sampling, resolve_server_args,
                                           spec_from_server_args, unsupported_request)
from spec_support import chi2_pvalue_ok, spec_bench

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
needs_sglang = pytest.mark.skipif(not HAS_SGLANG and not os.environ.get("CI"), reason="SGLang is not installed")
TESTS = Path(__file__).resolve().parent
STUB_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS / "sglang_stub"), str(TESTS)])}


def server_args(**kw) -> SimpleNamespace:
    """The ``ServerArgs`` fields the plugin reads, at SGLang's defaults (GPU, triton backend)."""
    base = dict(
        speculative_num_draft_tokens=None, speculative_num_steps=None, speculative_eagle_topk=None,
        speculative_draft_model_path=None, speculative_draft_model_quantization=None, max_running_requests=None,
        disable_overlap_schedule=False, enable_mixed_chunk=False, attention_backend="triton",
        prefill_attention_backend=None, decode_attention_backend=None, page_size=1, tp_size=1, pp_size=1,
        enable_dp_attention=False, disaggregation_mode="null", speculative_use_rejection_sampling=False,
        speculative_accept_threshold_single=1.0, speculative_accept_threshold_acc=1.0,
    )  # fmt: skip
    base.update(kw)
    return SimpleNamespace(**base)


# -- flags and options file (no SGLang needed) ---------------------------------------------------
def test_flags_fill_defaults_and_map_to_the_config(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    sa = server_args()
    spec = resolve_server_args(sa)
    assert spec.drafter == "auto" and spec.max_nodes == 16
    assert (sa.speculative_num_draft_tokens, sa.speculative_num_steps, sa.speculative_eagle_topk) == (17, 8, 4)
    assert sa.disable_overlap_schedule and sa.max_running_requests == 48
    sa = server_args(speculative_num_draft_tokens=9, speculative_num_steps=5, speculative_eagle_topk=2,
                     speculative_draft_model_path=str(SHIPPED_HEADS), max_running_requests=8)
    spec = resolve_server_args(sa)
    assert (spec.max_nodes, spec.max_depth, spec.tree_options.max_children) == (8, 5, 2)
    assert spec.drafter == f"hydra:{SHIPPED_HEADS}" and sa.max_running_requests == 8
    with pytest.raises(OptionsError, match="no config.json"):  # a wrong heads directory fails before any load
        resolve_server_args(server_args(speculative_draft_model_path=str(tmp_path)))
    opts = tmp_path / "dyntree.json"
    opts.write_text(json.dumps({"drafter": "ngram", "tree": "dyntree", "tree_options": {"threshold": 0.1}}))
    monkeypatch.setenv(ENV, str(opts))
    spec = spec_from_server_args(server_args(speculative_eagle_topk=3))
    assert spec.drafter == "ngram" and spec.tree == "dyntree"
    assert spec.tree_options.threshold == 0.1 and spec.tree_options.max_children == 3


@pytest.mark.parametrize("flags, names", [
    ({"enable_mixed_chunk": True}, "--enable-mixed-chunk"),
    ({"attention_backend": "torch_native"}, "--attention-backend torch_native"),
    ({"attention_backend": None}, "no --attention-backend"),
    ({"decode_attention_backend": "trtllm_mha"}, "--decode-attention-backend trtllm_mha"),
    ({"attention_backend": "fa3", "speculative_eagle_topk": 1}, "fa3 with --speculative-eagle-topk 1"),
    ({"page_size": 16}, "--page-size 16"),
    ({"tp_size": 2}, "--tp-size 2"),
    ({"pp_size": 2}, "--pp-size 2"),
    ({"enable_dp_attention": True}, "--enable-dp-attention"),
    ({"disaggregation_mode": "decode"}, "--disaggregation-mode decode"),
    ({"speculative_use_rejection_sampling": True}, "--speculative-use-rejection-sampling"),
    ({"speculative_accept_threshold_single": 0.5}, "--speculative-accept-threshold-single 0.5"),
    ({"speculative_accept_threshold_acc": 0.9}, "--speculative-accept-threshold-acc 0.9"),
    ({"speculative_num_draft_tokens": 1}, "--speculative-num-draft-tokens 1"),
    ({"speculative_num_draft_tokens": 4, "speculative_num_steps": 6}, "--speculative-num-steps 6"),
    ({"speculative_draft_model_quantization": "w8a8_int8"}, "--speculative-draft-model-quantization"),
])  # fmt: skip
def test_each_refusal_names_its_flag(flags, names, monkeypatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(OptionsError, match=names.replace("-", r"\-").replace("+", r"\+")):
        resolve_server_args(server_args(**flags))


@pytest.mark.parametrize("content, names", [
    (None, "no such file"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"max_nodes": 8}', "--speculative-num-draft-tokens"),
    ('{"max_depth": 4}', "--speculative-num-steps"),
    ('{"bogus": 1}', "bogus"),
    ('{"tree": "bushy"}', "tree"),
    ('{"drafter": "medusa"}', "drafter"),
    ('{"controller": {"min_gain": 0.5}}', "min_gain"),
    ('{"drafter": "qspec:w8a8"}', "weight-only"),
])  # fmt: skip
def test_options_file_errors_name_the_field(content, names, tmp_path, monkeypatch) -> None:
    path = tmp_path / "opts.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv(ENV, str(path))
    with pytest.raises(OptionsError, match=names):
        spec_from_server_args(server_args())


def test_draft_model_path_conflicting_with_the_file_is_refused(tmp_path, monkeypatch) -> None:
    path = tmp_path / "opts.json"
    path.write_text('{"drafter": "ngram"}')
    monkeypatch.setenv(ENV, str(path))
    with pytest.raises(OptionsError, match="--speculative-draft-model-path"):
        spec_from_server_args(server_args(speculative_draft_model_path="/heads"))


def test_controller_and_self_draft_options(tmp_path, monkeypatch) -> None:
    """The adaptive controller is on by default; the self-draft comes from the options file or from
    an int4 weight-only ``--speculative-draft-model-quantization`` the user set (SGLang's copy of the
    target's ``--quantization`` into it is not a request for it)."""
    monkeypatch.delenv(ENV, raising=False)
    assert resolve_server_args(server_args()).adaptive
    spec = spec_from_server_args(server_args(speculative_draft_model_quantization="awq"))
    assert spec.drafter == INT4_DRAFT
    inherited = server_args(quantization="fp8", speculative_draft_model_quantization="fp8")
    assert spec_from_server_args(inherited).drafter == "auto"
    assert spec_from_server_args(server_args(speculative_draft_model_quantization="fp8",
                                             _speculative_draft_quantization_explicitly_set=False)).drafter == "auto"
    path = tmp_path / "opts.json"
    path.write_text('{"drafter": "qspec:w4a16,g32", "adaptive": false}')
    monkeypatch.setenv(ENV, str(path))
    spec = spec_from_server_args(server_args(speculative_draft_model_quantization="gptq"))
    assert spec.drafter == "qspec:w4a16,g32" and not spec.adaptive
    path.write_text('{"drafter": "ngram"}')
    with pytest.raises(OptionsError, match="--speculative-draft-model-quantization awq selects"):
        spec_from_server_args(server_args(speculative_draft_model_quantization="awq"))


def test_request_sampling_and_refusals() -> None:
    sp = lambda **kw: SimpleNamespace(**{**dict(temperature=1.0, top_k=1, top_p=1.0, min_p=0.0, frequency_penalty=0.0,  # noqa: E731
                                              presence_penalty=0.0, repetition_penalty=1.0, logit_bias=None, json_schema=None,
                                              regex=None, ebnf=None, structural_tag=None), **kw})
    assert request_sampling(sp()).greedy  # SGLang's greedy: temperature 0 becomes top_k 1
    assert request_sampling(sp(temperature=0.0, top_k=1 << 30)).greedy
    got = request_sampling(sp(temperature=0.7, top_k=1 << 30, top_p=0.9))
    assert (got.temperature, got.top_k, got.top_p) == (0.7, 0, 0.9)
    assert request_sampling(sp(temperature=0.7, top_k=20)).top_k == 20
    assert unsupported_request(SimpleNamespace(sampling_params=sp(), return_logprob=False)) is None
    for kw, name in [({"frequency_penalty": 0.5}, "frequency_penalty"), ({"repetition_penalty": 1.1}, "repetition_penalty"),
                     ({"min_p": 0.1}, "min_p"), ({"logit_bias": {"1": 2.0}}, "logit_bias"),
                     ({"regex": "a+"}, "structured output")]:
        assert name in unsupported_request(SimpleNamespace(sampling_params=sp(**kw), return_logprob=False))
    assert "logprobs" in unsupported_request(SimpleNamespace(sampling_params=sp(), return_logprob=True))


# -- registration -----------------------------------------------------------------------------------
def _registered_in_child(queue) -> None:
    from sglang.srt.plugins import load_plugins
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    load_plugins()
    queue.put(type(SpeculativeAlgorithm.from_string("dyntree")).__name__)


@needs_sglang
def test_entry_point_registers_dyntree_here_and_in_a_spawned_child() -> None:
    from importlib.metadata import entry_points

    from sglang.srt.plugins import load_plugins
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "dyntree"]
    assert [ep.value for ep in eps] == ["dyntree.sglang_plugin:register"]
    load_plugins()
    eps[0].load()()  # idempotent: a second call changes nothing
    algo = SpeculativeAlgorithm.from_string("dyntree")
    assert type(algo).__name__ == "DynTreeSpec" and algo.is_speculative() and not algo.is_eagle()
    assert not algo.has_draft_kv() and not algo.need_topk() and algo.get_platform_worker_cls() is None
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_registered_in_child, args=(queue,))
    child.start()
    child.join(120)
    assert child.exitcode == 0 and queue.get(timeout=5) == "DynTreeSpec"


@needs_sglang
def test_spec_class_has_every_method_of_the_installed_enum() -> None:
    from sglang.srt.speculative.spec_registry import _assert_custom_spec_algo_conforms

    from dyntree.sglang_plugin.spec import missing_methods, spec_class

    assert missing_methods(spec_class()) == []
    _assert_custom_spec_algo_conforms(spec_class())  # SGLang's own check of the is_*/supports_* predicates

    class Partial:  # the check must notice what is missing
        def is_some(self) -> bool:
            return True

    assert "create_future_map" in missing_methods(Partial) and "is_eagle" in missing_methods(Partial)


def test_other_sglang_versions_are_refused() -> None:
    from dyntree.sglang_plugin import check_version

    check_version("0.5.23")
    with pytest.raises(RuntimeError, match="supports SGLang 0.5.23; this is SGLang 0.5.22"):
        check_version("0.5.22")


def _resolve(args: list[str], **env: str) -> dict:
    proc = subprocess.run([sys.executable, str(TESTS / "sglang_resolve.py"), *args], env={**STUB_ENV, **env},
                          capture_output=True, text=True, timeout=300)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, proc.stderr[-4000:]
    return json.loads(line[0][len("RESULT"):])


@needs_sglang
@pytest.mark.slow
def test_sglang_resolves_dyntree_server_args() -> None:
    """SGLang's own CLI parsing and resolution pipeline, with the plugin loaded."""
    from dyntree.models import model_path

    base = ["--model-path", str(model_path("smollm2")), "--device", "cpu", "--speculative-algorithm", "dyntree"]
    out = _resolve(base + ["--attention-backend", "triton", "--speculative-num-draft-tokens", "9"])
    assert (out["speculative_algorithm"], out["speculative_num_draft_tokens"], out["speculative_num_steps"]) == ("DYNTREE", 9, 8)
    assert out["disable_overlap_schedule"] and out["max_running_requests"] == 48 and out["decode_cuda_graph"] == "disabled"
    refused = _resolve(base)  # this CPU has no AMX: SGLang falls back to torch_native, which ignores tree masks
    assert "OptionsError" in refused["error"] and "--attention-backend torch_native" in refused["error"]


@needs_sglang
@pytest.mark.slow
def test_sglang_serve_example_resolves(tmp_path) -> None:
    """``examples/sglang_serve.sh`` with ``python -m sglang.launch_server`` intercepted: its flags
    and options file go through SGLang's resolution (serving needs a GPU)."""
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "sglang.launch_server" ]; then shift 2; exec {sys.executable} {TESTS / "sglang_resolve.py"} "$@"; fi
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(TESTS.parent / "examples" / "sglang_serve.sh"), "--device", "cpu"],
                          env={**STUB_ENV, "PYTHON": str(fake)}, capture_output=True, text=True, timeout=300)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, proc.stderr[-4000:]
    out = json.loads(line[0][len("RESULT"):])
    assert out["speculative_num_draft_tokens"] == 17 and out["speculative_eagle_topk"] == 4
    assert out["options_file"].endswith("examples/sglang_options.json") and out["attention_backend"] == "triton"


# -- the worker, against the stand-in target --------------------------------------------------------
SLOTS = {"speculative_num_draft_tokens": 13, "speculative_num_steps": 6}
TEMP, TOP_P = 0.8, 0.95


@pytest.fixture(scope="module")
def worker_runs(tmp_path_factory) -> dict:
    if not HAS_SGLANG:
        if os.environ.get("CI"):
            pytest.fail("SGLang is not installed (CI installs sglang==0.5.23 with --no-deps)")
        pytest.skip("SGLang is not installed")
    from transformers import AutoTokenizer

    from dyntree.models import model_path

    tok = AutoTokenizer.from_pretrained(model_path("smollm2"))
    rows = spec_bench(8, stride=60)
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": r["turns"][0]}], add_generation_prompt=True,
                                            return_dict=True)["input_ids"]) for r in rows]
    fixed = {"adaptive": False}  # every step verifies a full tree (controls and the sampling check)
    runs = [
        {"name": "ngram", "options": {"drafter": "ngram"}, "flags": SLOTS},
        {"name": "hydra", "options": {"drafter": "hydra", "tree": "dyntree"}, "flags": SLOTS},
        {"name": "qspec", "options": {"drafter": "qspec"}, "flags": SLOTS},
        {"name": "qspec_flag", "options": fixed, "flags": {**SLOTS, "speculative_draft_model_quantization": "awq"},
         "limit": 4},
        {"name": "hydra_full_chunked", "options": {"drafter": "hydra", **fixed}, "mask_mode": "full", "chunked": True,
         "flags": {"speculative_num_draft_tokens": 9, "speculative_eagle_topk": 2}},
        {"name": "no_speculation", "options": {"drafter": "hydra", "controller": {"min_gain": 50}}, "flags": SLOTS,
         "limit": 4},
        {"name": "sampled", "options": {"drafter": "hydra", "tree": "dyntree", **fixed}, "flags": SLOTS,
         "prompts": [tok("The best programming language is")["input_ids"]], "copies": 256, "max_new": 2,
         "sampling": {"temperature": TEMP, "top_k": 1 << 30, "top_p": TOP_P}, "pool_size": 12288},
        *[{"name": f"ablate_{a}", "options": {"drafter": "hydra", **fixed}, "ablate": [a], "flags": SLOTS, "limit": 4,
           "max_new": 16} for a in ("mask", "positions", "compaction")],
        # the self-draft's trees are laid out depth first, likeliest chain first, and it is nearly
        # always that chain which is accepted, where skipping the compaction changes nothing: the
        # control needs longer runs to meet a step that accepts another branch
        {"name": "ablate_compaction_qspec", "options": {"drafter": "qspec", **fixed}, "ablate": ["compaction"],
         "flags": SLOTS},
    ]  # fmt: skip
    work = tmp_path_factory.mktemp("sglang")
    (work / "cases.json").write_text(json.dumps({"prompts": prompts, "max_new": 32, "runs": runs}))
    proc = subprocess.run([sys.executable, str(TESTS / "sglang_runs.py"), str(work / "cases.json"), str(work / "out.json")],
                          env={**STUB_ENV, "OMP_NUM_THREADS": "2"}, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        pytest.fail(f"SGLang worker runs failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads((work / "out.json").read_text())


ADAPTIVE_RUNS = ("ngram", "hydra", "qspec")  # the defaults: the controller decides from measured forward times


@pytest.mark.slow
@pytest.mark.parametrize("run", [*ADAPTIVE_RUNS, "qspec_flag", "hydra_full_chunked"])
def test_worker_greedy_is_token_identical_to_plain_decoding(worker_runs, run) -> None:
    out = worker_runs[run]
    plain = worker_runs["plain"]["tokens"][: len(out["tokens"])]
    assert len(plain) in (4, 8) and all(len(t) == 32 for t in plain)
    assert out["tokens"] == plain
    assert out["adaptive"] == (run in ADAPTIVE_RUNS)
    assert 1 <= min(out["widths"]) and max(out["widths"]) <= out["width"]
    if out["adaptive"]:  # later decisions follow this machine's timings; the first step's plan does not
        assert max(out["widths"]) > 1  # (an unseen cost model prices verifies flat: trees are planned)
    else:  # fixed trees: every step verifies a tree, and some drafts are accepted
        assert out["accepted"] > 0 and out["steps"] < 32


@pytest.mark.slow
def test_worker_runs_the_quantized_self_draft(worker_runs) -> None:
    assert worker_runs["qspec"]["drafter"] == worker_runs["qspec_flag"]["drafter"] == "qspec"
    flag = worker_runs["qspec_flag"]  # fixed trees: the target's own int4 weights draft most tokens
    assert flag["accepted"] > sum(len(t) for t in flag["tokens"]) // 2


@pytest.mark.slow
def test_controller_falls_back_to_plain_decoding_inside_the_worker(worker_runs) -> None:
    """When speculation cannot pay (here: a 50x gain demanded), every step verifies the root only
    (a width-1 TARGET_VERIFY) and outputs stay those of plain decoding."""
    out = worker_runs["no_speculation"]
    assert out["tokens"] == worker_runs["plain"]["tokens"][:4]
    assert set(out["widths"]) == {1} and out["accepted"] == 0 and out["steps"] == 31


@pytest.mark.slow
def test_worker_uses_the_shipped_heads_and_the_flag_width(worker_runs) -> None:
    assert worker_runs["hydra"]["drafter"] == "hydra" and worker_runs["hydra"]["width"] == 13
    assert worker_runs["hydra_full_chunked"]["width"] == 9


@pytest.mark.slow
@pytest.mark.parametrize("ablation", ["mask", "positions", "compaction", "compaction_qspec"])
def test_each_worker_ablation_diverges(worker_runs, ablation) -> None:
    out = worker_runs[f"ablate_{ablation}"]["tokens"]
    plain = [t[: len(out[0])] for t in worker_runs["plain"]["tokens"][: len(out)]]
    assert len(out) == (len(worker_runs["plain"]["tokens"]) if ablation == "compaction_qspec" else 4)
    assert out != plain


@pytest.mark.slow
def test_worker_sampling_keeps_the_target_distribution(worker_runs) -> None:
    """256 copies of one prompt: token 0 is the prefill's argmax, token 1 comes out of the first
    verified tree (drafts accepted or rejected by the speculator's lossless tree sampling), so
    its distribution must be the target's after temperature and top-p, known exactly."""
    import torch

    from dyntree.common.sampling import process_logits

    run = worker_runs["sampled"]
    assert run["accepted"] > 0  # some verified drafts were accepted, some rejected
    counts = torch.bincount(torch.tensor([t[1] for t in run["tokens"]]), minlength=49152).double()
    logits = torch.tensor(run["next_token_logits"])[None]
    p = process_logits(logits, TEMP, 0, TOP_P)[0]
    assert float(p[counts > 0].min()) > 0, "sampled a token the target gives probability zero"
    ok, stat, crit = chi2_pvalue_ok(counts, p)
    assert ok, f"SGLang worker's sampled tokens differ from the target distribution: chi2 {stat:.1f} > {crit:.1f}"
    wrong = process_logits(logits, 2 * TEMP, 0, TOP_P)[0]  # control: the test tells a wrong distribution
    assert not chi2_pvalue_ok(counts, wrong)[0]
