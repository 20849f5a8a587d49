"""`dyntree bench`: plain decoding and speculative modes side by side on a prompt file.

Every mode runs through the same :class:`SpecEngine` (mode ``none`` = the ``none`` drafter), on
the same prompts, batch size and dtype, so tokens/s, tau and outputs are directly comparable.
Modes: ``none`` (plain decoding), ``own`` (the drafter's own trees), ``chain`` / ``static`` /
``dyntree`` / ``beam`` (the tree builder over the drafter's candidates). With
``SpecConfig.adaptive`` every speculative mode runs under the controller (its cost model is timed
once per bench and shared). Two modes run Hugging Face transformers' own ``model.generate`` on the
same model object instead, as the reference a user already has: ``hf`` (greedy) and ``hf-lookup``
(its prompt lookup decoding, ``prompt_lookup_num_tokens=10``); one prompt at a time, greedy only.
With ``lockstep`` the engine modes run interleaved, one prefill or step of each in turn, and each is
timed by its own units (:func:`run_lockstep`): the comparison then holds on a machine whose speed
drifts by 10% over seconds. The result is one JSON document (schema in docs/cli.md).
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Collection, Sequence

import torch
from tqdm.auto import tqdm

from dyntree.common.config import SamplingParams, SpecConfig
from dyntree.common.cost_model import CostModel
from dyntree.common.drafters import AUTO, make_drafter
from dyntree.models import machine_kind
from dyntree.standalone.engine import RequestOutput, SpecEngine
from dyntree.standalone.target import make_hf_drafter, resolve_hf_drafter

__all__ = ["Prompt", "load_prompts", "encode_prompt", "run_bench", "run_mode", "run_lockstep", "run_hf_mode", "compare",
           "mode_spec", "MODES", "HF_MODES"]

#: transformers ``generate`` keyword arguments of the ``hf*`` modes.
HF_MODES = {"hf": {}, "hf-lookup": {"prompt_lookup_num_tokens": 10}}
MODES = ("none", "own", "chain", "static", "dyntree", "beam", *HF_MODES)
WARMUP_TOKENS = 8  # tokens generated once per mode before the timed runs


@dataclass(frozen=True)
class Prompt:
    id: Any
    text: str
    category: str | None = None


def load_prompts(
    path: str | Path,
    limit: int | None = None,
    categories: Sequence[str] | None = None,
    per_category: int | None = None,
) -> list[Prompt]:
    """Read a JSONL prompt file: text from ``turns`` (first turn), ``prompt`` or ``question``;
    id from ``id``, ``question_id`` or ``task_id`` (else the line number). ``categories`` keeps
    only those ``category`` values, ``per_category`` the first N of each, ``limit`` the first N."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    prompts: list[Prompt] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{lineno}: a prompt line must be a JSON object, got {type(rec).__name__}")
            if "turns" in rec and rec["turns"]:
                text = rec["turns"][0]
            elif "prompt" in rec:
                text = rec["prompt"]
            elif "question" in rec:
                text = rec["question"]
            else:
                raise ValueError(f"{path}:{lineno}: a prompt line needs `turns`, `prompt` or `question`")
            if not isinstance(text, str) or not text:
                raise ValueError(f"{path}:{lineno}: the prompt text is empty or not a string")
            pid = next((rec[k] for k in ("id", "question_id", "task_id") if k in rec), lineno)
            cat = rec.get("category")
            if categories and cat not in categories:
                continue
            if per_category is not None and sum(p.category == cat for p in prompts) >= per_category:
                continue
            prompts.append(Prompt(pid, text, cat))
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        what = f" in categories {list(categories)}" if categories else ""
        raise ValueError(f"prompt file {path} holds no prompts{what}")
    return prompts


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids for ``text``; with ``chat``, wrapped in the model's chat template."""
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer(text).input_ids


def _versions() -> dict[str, str]:
    import transformers

    import dyntree

    return {"dyntree": dyntree.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def _device() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def _tau(outs: Sequence[RequestOutput]) -> float:
    """Tokens the requests' verify steps committed over those steps (0.0 without steps)."""
    steps = sum(o.steps for o in outs)
    return round(sum(o.step_tokens for o in outs) / steps, 4) if steps else 0.0


def tau_by_group(outs: Sequence[RequestOutput], groups: dict[str, Collection[Any]]) -> dict[str, float]:
    """Tau over each group's requests (``groups``: name -> request ids; a request may sit in several)."""
    return {g: _tau([o for o in outs if o.request_id in ids]) for g, ids in groups.items()}


def _summarise(mode: str, drafter: str, outs: list[RequestOutput], wall: float) -> dict[str, Any]:
    steps = sum(o.steps for o in outs)
    tokens = sum(len(o.token_ids) for o in outs)
    depth = max((len(o.accepted_per_depth) for o in outs), default=0)
    per_depth = [sum(o.accepted_per_depth[d] for o in outs if d < len(o.accepted_per_depth)) / max(steps, 1)
                 for d in range(depth)]
    return {
        "mode": mode,
        "drafter": drafter,
        "tokens": tokens,
        "steps": steps,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 3) if wall > 0 else 0.0,
        "tau": _tau(outs),
        "accepted_per_depth": [round(x, 4) for x in per_depth],
        "draft_nodes_per_step": round(sum(o.draft_nodes for o in outs) / max(steps, 1), 3),
        "outputs": [{"id": o.request_id, "token_ids": o.token_ids} for o in outs],
    }


def run_hf_mode(model, tokenizer, encoded: Sequence[Sequence[int]], ids: Sequence[Any], mode: str,
                params: SamplingParams) -> dict[str, Any]:
    """One bench run of transformers' ``model.generate`` (``hf`` / ``hf-lookup``), prompt by prompt,
    greedy, with the engine's end-of-sequence tokens. tau and steps are not observable (``None``)."""
    if not params.greedy or params.stop:
        raise ValueError(f"mode {mode!r} runs greedy decoding without stop strings only")
    eos = sorted(SpecEngine(model, tokenizer, make_drafter("none"), SpecConfig(drafter="none"), fast_linear=False,
                          fast_attention=False).eos_ids(params))
    kwargs = dict(do_sample=False, eos_token_id=eos or None, pad_token_id=eos[0] if eos else None, **HF_MODES[mode])
    device = next(model.parameters()).device

    def generate(prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        x = torch.tensor([list(prompt)], device=device)
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, **kwargs)
        return out[0, x.shape[1] :].tolist()

    with torch.inference_mode():
        generate(encoded[0], WARMUP_TOKENS)
        outs, start = [], time.perf_counter()
        for pid, prompt in zip(ids, tqdm(encoded, desc=f"bench {mode}", unit="prompt", leave=False)):
            outs.append({"id": pid, "token_ids": generate(prompt, params.max_new_tokens)})
        wall = time.perf_counter() - start
    tokens = sum(len(o["token_ids"]) for o in outs)
    return {"mode": mode, "drafter": "transformers", "tokens": tokens, "steps": None, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 3) if wall > 0 else 0.0, "decode_tokens_per_s": None, "tau": None,
            "accepted_per_depth": [], "draft_nodes_per_step": None, "outputs": outs, "build_ms_per_step": None}


def mode_spec(mode: str, spec: SpecConfig) -> tuple[str | None, SpecConfig]:
    """The drafter spec (``None``: plain decoding) and engine config of one bench mode."""
    if mode not in MODES or mode in HF_MODES:
        raise ValueError(f"unknown engine mode {mode!r}; choose from {', '.join(m for m in MODES if m not in HF_MODES)}")
    if mode == "none":
        return None, spec.model_copy(update={"drafter": "none", "tree": None, "adaptive": False})
    return spec.drafter, spec.model_copy(update={"tree": None if mode == "own" else mode})


def run_mode(
    model,
    tokenizer,
    encoded: Sequence[Sequence[int]],
    ids: Sequence[Any],
    mode: str,
    spec: SpecConfig,
    params: SamplingParams,
    batch_size: int,
    cost: CostModel | None = None,
    groups: dict[str, Collection[Any]] | None = None,
    fast_linear: bool = True,
    fast_attention: bool = True,
) -> dict[str, Any]:
    """One bench run of ``mode`` over the encoded prompts, at most ``batch_size`` decoding at once
    (continuous batching: a finished request's slot goes to the next prompt at once).

    ``cost`` seeds an adaptive engine's cost model (a copy; measured here when ``None``);
    ``fast_linear`` / ``fast_attention`` are the engine's CPU linear and attention routing."""
    run = _ModeRun(model, tokenizer, encoded[0], mode, spec, params, batch_size, cost, fast_linear, fast_attention)
    start = time.perf_counter()
    outs = run.engine.generate(encoded, params, ids, progress=True, max_batch_size=batch_size)
    return run.report(outs, time.perf_counter() - start, groups)


def run_lockstep(
    model,
    tokenizer,
    encoded: Sequence[Sequence[int]],
    ids: Sequence[Any],
    jobs: Sequence[tuple[str, SpecConfig]],
    params: SamplingParams,
    batch_size: int,
    cost: CostModel | None = None,
    groups: dict[str, Collection[Any]] | None = None,
    fast_linear: bool = True,
    fast_attention: bool = True,
) -> list[dict[str, Any]]:
    """Bench runs of several ``(mode, spec)`` jobs over the same prompts, interleaved one unit of
    work (a prefill or a decoding step) at a time: each job's time is the sum of its own units, so
    a phase in which a shared machine runs slower hits every job alike (a unit is far shorter than
    such a phase). The job that goes first rotates every cycle. Each job's outputs,
    steps and statistics are what a run of its own gives: the engines share only the model's
    weights."""
    runs = [_ModeRun(model, tokenizer, encoded[0], m, s, params, batch_size, cost, fast_linear, fast_attention)
            for m, s in jobs]
    work = {j: r.engine.stepwise(encoded, params, ids, max_batch_size=batch_size) for j, r in enumerate(runs)}
    spent = [0.0] * len(runs)
    outs: dict[int, list[RequestOutput]] = {}
    bar = tqdm(total=len(runs), desc="lockstep jobs", leave=False)
    with runs[0].engine.kernel_scope():  # the model's attention switched once, not per unit
        cycle = 0
        while work:
            live = sorted(work)
            for j in live[cycle % len(live) :] + live[: cycle % len(live)]:
                t0 = time.perf_counter()
                try:
                    next(work[j])
                except StopIteration as done:
                    outs[j] = done.value
                    del work[j]
                    bar.update(1)
                spent[j] += time.perf_counter() - t0
            cycle += 1
    bar.close()
    return [r.report(outs[j], spent[j], groups) for j, r in enumerate(runs)]


class _ModeRun:
    """One bench job's engine, set up and warmed up (outside any timing), and its report."""

    def __init__(self, model, tokenizer, warm_prompt: Sequence[int], mode: str, spec: SpecConfig,
                 params: SamplingParams, batch_size: int, cost: CostModel | None, fast_linear: bool,
                 fast_attention: bool) -> None:
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        self.mode = mode
        name, self.cfg = mode_spec(mode, spec)
        self.name = name or "none"
        seed = cost.copy() if cost is not None and self.cfg.adaptive else None
        self.engine = SpecEngine(model, tokenizer, make_hf_drafter(self.name, model, tokenizer), self.cfg,
                                 cost_model=seed, fast_linear=fast_linear, fast_attention=fast_attention)
        self.startup = self.engine.prepare()
        # Warm-up (CUDA/cuBLAS initialisation, Triton compiles, first-call allocations) outside the timings.
        warm = params.model_copy(update={"max_new_tokens": WARMUP_TOKENS})
        self.engine.generate([warm_prompt], warm, ["warm-up"])
        self.engine.speculator.stats.reset()

    def report(self, outs: list[RequestOutput], wall: float,
               groups: dict[str, Collection[Any]] | None) -> dict[str, Any]:
        """The run's result record; ``wall``: the seconds its decoding took; ``groups``: prompt
        groups (name -> request ids; a request may sit in several) whose tau ``by_category`` gives."""
        engine, cfg, name = self.engine, self.cfg, self.name
        run = _summarise(self.mode, name, outs, wall)
        t = engine.speculator.stats
        n = max(t.steps, 1)
        step_s = t.draft_s + t.forward_s + t.accept_s
        run.update({
            "tree": cfg.tree,
            "adaptive": cfg.adaptive,
            "max_nodes": cfg.max_nodes if name != "none" else 0,
            "max_depth": cfg.max_depth if name != "none" else 0,
            "draft_s": round(t.draft_s, 3),
            "verify_s": round(t.forward_s + t.accept_s, 3),
            "engine_steps": t.steps,
            "step_ms": round(step_s / n * 1e3, 3),
            "forward_ms_per_step": round(t.forward_s / n * 1e3, 3),
            "accept_ms_per_step": round(t.accept_s / n * 1e3, 3),
            "draft_ms_per_step": round(t.draft_s / n * 1e3, 3),
            # planning and tree building (draft minus the drafter's own calls); none without a builder
            "build_ms_per_step": round(t.build_s / n * 1e3, 3) if engine.speculator.builder else None,
            "build_pct_of_step": (round(100 * t.build_s / step_s, 2) if step_s > 0 else 0.0)
            if engine.speculator.builder else None,
            "startup_s": round(self.startup, 3),
            "prefill_s": round(engine.prefill_s, 3),
            # decoding alone: the prefills (the same work in every mode) and the first token of each
            # request, which they give, taken out; what speculation can change
            "decode_tokens_per_s": _decode_rate(run["tokens"] - len(outs), wall - engine.prefill_s),
        })  # fmt: skip
        if groups is not None:
            run["by_category"] = tau_by_group(outs, groups)
        return run


def _decode_rate(tokens: int, seconds: float) -> float | None:
    return round(tokens / seconds, 3) if seconds > 0 else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def compare(base: dict[str, Any] | None, run: dict[str, Any]) -> None:
    """Add ``identical_to_none``, ``speedup`` (end to end, prefills included) and
    ``decode_speedup`` (decoding alone; ``None`` for transformers' modes, whose prefill is not
    timed apart) of ``run`` against the plain run ``base``."""
    if base is None:
        run["identical_to_none"] = None
        run["speedup"] = run["decode_speedup"] = None
        return
    ref = {o["id"]: o["token_ids"] for o in base["outputs"]}
    same = [o["token_ids"] == ref[o["id"]] for o in run["outputs"]]
    run["identical_to_none"] = round(sum(same) / len(same), 4)
    run["speedup"] = _ratio(run["tokens_per_s"], base["tokens_per_s"])
    run["decode_speedup"] = _ratio(run.get("decode_tokens_per_s"), base.get("decode_tokens_per_s"))


def _median_run(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's runs over the rounds -> its median run (by tokens/s; the lower middle one for an
    even count) with every round's tokens/s and speedup, the median speedup, and
    ``identical_to_none`` as the worst round's."""
    order = sorted(range(len(rounds)), key=lambda i: rounds[i]["tokens_per_s"])
    run = dict(rounds[order[(len(rounds) - 1) // 2]])
    run["tokens_per_s_runs"] = [x["tokens_per_s"] for x in rounds]
    if run["speedup"] is not None:
        run["speedup_runs"] = [x["speedup"] for x in rounds]
        run["speedup"] = round(statistics.median(run["speedup_runs"]), 4)
        run["identical_to_none"] = min(x["identical_to_none"] for x in rounds)
    if run.get("decode_speedup") is not None:
        run["decode_speedup_runs"] = [x["decode_speedup"] for x in rounds]
        run["decode_speedup"] = round(statistics.median(run["decode_speedup_runs"]), 4)
    return run


def run_bench(
    model,
    tokenizer,
    prompts: Sequence[Prompt],
    modes: Sequence[str],
    drafter: str | Sequence[str],
    spec: SpecConfig,
    params: SamplingParams,
    batch_size: int,
    chat: bool,
    model_name: str,
    dtype: str,
    fast_linear: bool = True,
    repeats: int = 1,
    fast_attention: bool = True,
    lockstep: bool = False,
) -> dict[str, Any]:
    """Run every mode over ``prompts`` and return the result document.

    ``drafter``: one drafter spec or several (``auto`` is resolved first, so runs name the drafter
    that ran); every speculative mode runs with each of them, and all share the one plain (``none``) and transformers runs. ``repeats``: the whole list of runs
    is repeated round by round (each round starting one run later than the last, so no mode
    always runs first, and a slow phase of the machine hits every mode alike); each mode then
    reports its median run, the tokens/s of every round, and as ``speedup`` the median over
    rounds of its tokens/s over that round's plain run. ``lockstep``: in each round the engine modes
    run interleaved step by step (:func:`run_lockstep`; transformers' modes after them, one by
    one), so a slow phase of a shared machine hits them alike even within a round."""
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if batch_size > 1 and any(m in HF_MODES for m in modes):
        raise ValueError(f"modes {', '.join(HF_MODES)} run one prompt at a time; use --batch-size 1")
    drafters = [drafter] if isinstance(drafter, str) else list(drafter)
    if not drafters:
        raise ValueError("run_bench needs at least one drafter")
    drafters = [resolve_hf_drafter(d, model, tokenizer)[1] if d == AUTO else d for d in drafters]
    tree_modes = [m for m in modes if m in ("chain", "static", "dyntree")]
    for d in drafters if tree_modes else ():
        if not make_hf_drafter(d, model, tokenizer).drafts_with_builder:
            raise ValueError(f"mode(s) {tree_modes} need a drafter with expand; {d!r} has none (use mode own)")
    jobs = [(m, d) for m in modes for d in ([None] if m == "none" or m in HF_MODES else drafters)]
    encoded = [encode_prompt(tokenizer, p.text, chat) for p in prompts]
    ids = [p.id for p in prompts]
    category = {c: {p.id for p in prompts if p.category == c}
                for c in sorted({p.category for p in prompts if p.category is not None})}
    plain = SpecEngine(model, tokenizer, make_drafter("none"), SpecConfig(drafter="none"), fast_linear=fast_linear,
                       fast_attention=fast_attention)
    cost = plain.measure_cost() if spec.adaptive and any(m != "none" for m in modes) else None

    def job_spec(d: str | None) -> SpecConfig:
        return spec.model_copy(update={"drafter": d or drafters[0]})

    def run(mode: str, d: str | None) -> dict[str, Any]:
        if mode in HF_MODES:
            return run_hf_mode(model, tokenizer, encoded, ids, mode, params)
        return run_mode(model, tokenizer, encoded, ids, mode, job_spec(d), params, batch_size, cost, category,
                        fast_linear, fast_attention)

    rounds = []
    for r in tqdm(range(repeats), desc="rounds", disable=repeats == 1, leave=False):
        order = [(j + r) % len(jobs) for j in range(len(jobs))]  # each round starts one job later
        done: dict[int, dict[str, Any]] = {}
        if lockstep:
            engine_jobs = [j for j in order if jobs[j][0] not in HF_MODES]
            both = run_lockstep(model, tokenizer, encoded, ids, [(jobs[j][0], job_spec(jobs[j][1])) for j in engine_jobs],
                                params, batch_size, cost, category, fast_linear, fast_attention)
            done.update(zip(engine_jobs, both))
        done.update({j: run(*jobs[j]) for j in order if j not in done})
        rounds.append([done[j] for j in range(len(jobs))])
        base = next((x for x in rounds[-1] if x["mode"] == "none"), None)
        for x in rounds[-1]:
            compare(base, x)
    runs = [_median_run([rnd[j] for rnd in rounds]) for j in range(len(jobs))]
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": _device(),
        "machine": machine_kind(next(model.parameters()).device),
        "versions": _versions(),
        "model": model_name,
        "dtype": dtype,
        "batch_size": batch_size,
        "chat": chat,
        "num_prompts": len(prompts),
        "repeats": repeats,
        "lockstep": lockstep,
        "drafters": drafters,
        "spec": spec.model_dump(),
        "sampling": params.model_dump(),
        "linear": {"routing": plain.linear.summary(), "ms_by_rows": plain.linear.timings_ms} if plain.linear else None,
        "attention": plain.attention.summary() if plain.attention else None,
        "cost_model_ms": dict(zip(cost.xs, [round(y, 3) for y in cost.ys])) if cost is not None else None,
        "cost_model_attn_us_per_query_kv": round(cost.attn_ms * 1e3, 4) if cost is not None else None,
        "cost_model_attn_us_per_row_kv": round(cost.row_ms * 1e3, 4) if cost is not None else None,
        "runs": runs,
    }
