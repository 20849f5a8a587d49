"""vLLM with and without dyntree, side by side: no speculation, vLLM's own ``ngram``, and
``{"method": "dyntree"}`` with the default (``auto``) and each drafter, on SmolLM2-135M-Instruct;
``none_sync`` is no speculation without vLLM's async scheduling, which vLLM turns off for ngram
and dyntree on a GPU (on a CPU it is always off: ``none_sync`` is then an A/A control; see
:data:`ENGINE_ARGS`).

    python benchmarks/vllm_bench.py [--rounds 3] [--dtype auto] [--out benchmarks/results/vllm/<machine>_<dtype>.json]

Prompt sets (Spec-Bench, chat template, first turn): ``chat`` = 8 MT-Bench questions from its
non-coding categories, ``code`` = 8 MT-Bench coding questions. Every config's ``LLM`` runs in
processes of its own (vLLM's multiprocess engine core, as ``vllm serve`` runs it: vLLM's CPU
platform then gives the model one core and keeps the other for the engine core), all of them alive
at once, each after one untimed warm-up pass; every set runs at batch 1 (prompts one by one), batch
8 (all 8 at once) and batch 16 (both sets together), and each ``generate`` call (one batch of one
cell) is run by every config back to back, the order rotated and reversed call by call
(:func:`call_order`), so a config and its baseline are timed seconds apart and a slow spell of a
shared machine hits both; a round is one pass over every cell. Per config, set and batch: tokens/s
per round (generated tokens over the wall time of ``LLM.generate``), their median and spread, tau
(1 + accepted draft tokens per drafting step, from vLLM's spec-decode counters), drafting steps, the
median over rounds of the per-round speedup against no speculation and against vLLM ``ngram``, and
the share of outputs identical to no speculation's (token for token; in bf16 a verify pass may flip
a near-tied argmax, so only fp32 promises identity). Each engine's worker times its model forwards
(:func:`_worker_forwards`): each call's time inside them, the median forward of its plain steps at
the full batch (``plain_forward_ms``: every request one query token; the same work in every
config, so it shows how fast that engine runs), and per config the median over rounds of the time
it spends outside the forward per token beyond plain decoding's, as a share of plain decoding's
time per token (``outside_forward_vs_none``): drafting, verification and hooks. ``--in-process``
runs every engine in this one process instead (vLLM's engine in-process: no core reserved, no
threads bound). ``--bracket`` also runs plain
decoding right after every other config's call and reads each call over the plain calls just before
and after it (``bracketed``, with every call's record): at batch 8 and 16 a shared machine's speed
drifts within a round by more than the few percent a config is judged by. Every run with plain
decoding also pools each call over the round's plain engines in the same cell (``pooled``: the
mean of ``none`` and ``none_sync`` where both run): two engines of one config run at speeds up to
~9% apart for as long as they live, so one plain engine alone is a noisy yardstick. ``--preload`` runs every
engine with the libraries vLLM's CPU install guide preloads (tcmalloc, Intel OpenMP).
``--fresh-engines`` builds every config's engines anew at each round; ``--warm-up N`` has each new
engine run every call of the run N times (1 when no N is given) before its counted calls
(tokens/s of those first calls kept as ``first_calls``): the adaptive controller's first learning,
a served engine's first seconds, is then not in every round of a fresh-engine run. Engines in
processes of their own are built after a spare plain engine that is never called: the first engine
built runs slow. Writes JSON (and a PNG of the speedups when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


ROOT = Path(__file__).resolve().parents[1]
SPEC_BENCH = Path(os.environ.get("DYNTREE_SHARED", ROOT.parent / "shared")) / "data" / "spec_bench" / "question.jsonl"
CONFIGS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "vllm_ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1},
    "dyntree": {"method": "dyntree"},  # the default: auto drafter (Hydra heads here), adaptive
    "dyntree_ngram": {"method": "dyntree", "drafter": "ngram"},
    "dyntree_hydra": {"method": "dyntree", "drafter": "hydra"},
    "dyntree_qspec": {"method": "dyntree", "drafter": "qspec"},
}
#: Engine arguments a config sets besides its speculative_config. On a GPU vLLM turns async
#: scheduling (the next step scheduled while this one runs) on by default and off for speculative
#: methods other than EAGLE-style ones, ngram and dyntree included: ``none_sync`` is plain decoding
#: without it, the baseline those configs run under. vLLM's CPU platform turns it off for every
#: config, so on a CPU ``none_sync`` is the same engine as ``none``: an A/A control whose spread
#: against ``none`` is the machine's noise.
ENGINE_ARGS: dict[str, dict[str, Any]] = {"none_sync": {"async_scheduling": False}}
CONFIGS["none_sync"] = None
#: A controller held to no drafting (plans never pass the bar, no probes): what an engine costs every step.
_NO_DRAFTING = {"min_gain": 1000, "probe_steps": 0}
#: Controls, run only when named in ``--configs``: for the adaptive controller, each drafter pinned
#: to the shape vLLM's own n-gram verifies (a chain of 4, every step it can draft), and the default
#: held to chains (the controller still picks their length, or no draft); the default with vLLM's
#: own LM head on every step (no fp16 screen for greedy steps); the default with a node budget of 8
#: (``dyntree_max8``); the default with a drafter's
#: catch-up priced whole at the step that pays it (``catch_up_steps: 1``, the pricing before it was
#: spread over the steps it serves); what a speculative config costs when it never drafts: dyntree
#: with a bar no plan clears and no probes, vLLM's n-gram with a match length no prompt reaches; the
#: default without probes; Hydra alone and the self-draft held to no drafting, Hydra without probes;
#: dyntree's n-gram with a request's acceptance prior weighing 8 observations (``dyntree_ngram_pw8``:
#: its acceptance after one-token matches, a rare hit, then moves less with each miss).
CONTROLS: dict[str, dict[str, Any]] = {
    "dyntree_chains": {"method": "dyntree", "tree": "chain"},
    "dyntree_fullhead": {"method": "dyntree", "screened_head": False},
    "dyntree_catchup1": {"method": "dyntree", "controller": {"catch_up_steps": 1}},
    "dyntree_chain4": {"method": "dyntree", "tree": "chain", "adaptive": False, "num_speculative_tokens": 4},
    "dyntree_ngram_chain4": {"method": "dyntree", "drafter": "ngram", "tree": "chain", "adaptive": False,
                             "num_speculative_tokens": 4},
    "dyntree_idle": {"method": "dyntree", "controller": _NO_DRAFTING},
    "dyntree_noprobe": {"method": "dyntree", "controller": {"probe_steps": 0}},
    "dyntree_hydra_idle": {"method": "dyntree", "drafter": "hydra", "controller": _NO_DRAFTING},
    "dyntree_hydra_noprobe": {"method": "dyntree", "drafter": "hydra", "controller": {"probe_steps": 0}},
    "dyntree_qspec_idle": {"method": "dyntree", "drafter": "qspec", "controller": _NO_DRAFTING},
    "dyntree_max8": {"method": "dyntree", "max_nodes": 8},
    "dyntree_ngram_pw8": {"method": "dyntree", "drafter": "ngram", "controller": {"prior_weight": 8}},
    "vllm_ngram_idle": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4096,
                        "prompt_lookup_min": 4096},
}
SETS = ("chat", "code")
BATCHES = (1, 8, 16)
#: ``engines`` key of the plain engine built first and never called (:func:`_build_engines`)
SPARE = "_spare"


def prompt_rows(n: int = 8) -> dict[str, list[dict[str, Any]]]:
    """The two prompt sets: Spec-Bench's MT-Bench part (its first 80 rows), coding and the rest."""
    rows = [json.loads(line) for line in SPEC_BENCH.open()][:80]
    code = [r for r in rows if r["category"] == "coding"][:n]
    chat = [r for r in rows if r["category"] != "coding"][:: 70 // n][:n]
    return {"chat": chat, "code": code}


def _counters(llm: Any) -> dict[str, float]:
    """The engine's own spec-decode counters (drafting steps, accepted tokens), read from its
    Prometheus logger: with several engines in one process, the registry that ``get_metrics``
    reads holds only the newest engine's."""
    for logger in llm.llm_engine.logger_manager.stat_loggers:
        prom = getattr(logger, "spec_decoding_prom", None)
        if prom is not None and prom.spec_decoding_enabled:
            return {"drafts": prom.counter_spec_decode_num_drafts[0]._value.get(),
                    "accepted": prom.counter_spec_decode_num_accepted_tokens[0]._value.get()}
    return {}


def _prompt_sets() -> dict[str, list[str]]:
    from transformers import AutoTokenizer

    from dyntree.models import model_path

    tok = AutoTokenizer.from_pretrained(str(model_path("smollm2")))
    return {name: [tok.apply_chat_template([{"role": "user", "content": r["turns"][0]}], tokenize=False,
                                           add_generation_prompt=True) for r in rows]
            for name, rows in prompt_rows().items()}


def _cells(sets: dict[str, list[str]], batches: tuple[int, ...] = BATCHES) -> list[tuple[str, list[str], int]]:
    """``(cell, prompts, batch)``: every set at batch 1 and 8, both sets together at batch 16 (of
    ``batches``)."""
    return [(f"{name}/b{b}", sets["chat"] + sets["code"] if b == 16 else sets[name], b)
            for b in batches for name in (SETS if b < 16 else ("chat+code",))]


def _engine(config: str, dtype: str, sets: dict[str, list[str]]) -> Any:
    """One config's ``LLM``, after an untimed warm-up pass over both ``sets``."""
    from vllm import LLM, SamplingParams

    from dyntree.models import model_path

    llm = LLM(model=str(model_path("smollm2")), dtype=dtype, max_model_len=2048, seed=0, enforce_eager=True,
              disable_log_stats=False, speculative_config=CONFIGS[config], **ENGINE_ARGS.get(config, {}))
    _time_forwards(llm)
    llm.generate(sets["chat"] + sets["code"], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    return llm


def _worker_forwards(worker: Any, read: bool) -> list[tuple[int, int, float]] | None:
    """Run in an engine's worker (``LLM.collective_rpc``, in this process or another): time its
    model runner's forward (once: installs the timer), or with ``read`` return and clear what it
    timed since the last read: per forward, the batch's requests, its query tokens and seconds."""
    runner = worker.model_runner
    if read:
        timed, runner._bench_forwards = runner._bench_forwards, []
        return timed
    if not hasattr(runner, "_bench_forwards"):
        runner._bench_forwards = []
        forward = runner._model_forward

        def timed_forward(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                ids = kwargs.get("input_ids")
                runner._bench_forwards.append((int(runner.input_batch.num_reqs), int(ids.shape[0]) if ids is not None else -1,
                                               time.perf_counter() - t))

        runner._model_forward = timed_forward
    return None


def _time_forwards(llm: Any) -> None:
    """Have ``llm``'s worker time its model forwards (:func:`_worker_forwards`): this module's
    function goes to a worker in another process by value, as a script's own does."""
    import cloudpickle

    if __name__ != "__main__" and __name__ in sys.modules:
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    llm.collective_rpc(_worker_forwards, args=(False,))


def _median_ms(seconds: list[float]) -> float | None:
    """The median of ``seconds`` in milliseconds (``None`` for none)."""
    return round(1e3 * statistics.median(seconds), 3) if seconds else None


class _Cell:
    """One config's runs of one cell: generated tokens, wall time of ``LLM.generate`` and of
    vLLM's model forward inside it, the forwards of plain steps at the full batch (every request
    one query token), outputs and the engine's spec-decode counters over those calls."""

    def __init__(self) -> None:
        self.tokens, self.wall, self.drafts, self.accepted, self.forward = 0, 0.0, 0.0, 0.0, 0.0
        self.plain_forwards: list[float] = []
        self.outputs: list[list[int]] = []

    def run(self, llm: Any, prompts: list[str], params: Any) -> None:
        before = _counters(llm)
        llm.collective_rpc(_worker_forwards, args=(True,))  # what the engine timed before this call
        t = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        self.wall += time.perf_counter() - t
        timed = llm.collective_rpc(_worker_forwards, args=(True,))[0]
        self.forward += sum(s for _, _, s in timed)
        self.plain_forwards += [s for reqs, tokens, s in timed if reqs == tokens == len(prompts)]
        after = _counters(llm)
        self.outputs += [list(o.outputs[0].token_ids) for o in res]
        self.tokens += sum(len(o.outputs[0].token_ids) for o in res)
        self.drafts += after.get("drafts", 0) - before.get("drafts", 0)
        self.accepted += after.get("accepted", 0) - before.get("accepted", 0)

    def result(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "wall_s": self.wall, "forward_s": self.forward,
                "plain_forward_ms": _median_ms(self.plain_forwards),
                "tokens_per_s": self.tokens / self.wall,
                "tau": 1 + self.accepted / self.drafts if self.drafts else 1.0, "drafting_steps": int(self.drafts),
                "outputs": self.outputs}


def interleaved(configs: list[str], dtype: str, max_tokens: int, rounds: int,
                batches: tuple[int, ...] = BATCHES, in_process: bool = False, bracket: bool = False,
                calls: list[dict[str, Any]] | None = None, settle: float = 0.0,
                fresh: bool = False, warm_up: int = 0,
                first_calls: dict[str, list[list[float]]] | None = None) -> list[dict[str, dict[str, Any]]]:
    """Every config's engine alive at once (each in processes of its own, or with ``in_process`` all
    in this one), each ``generate`` call (one batch of one cell) run by every config back to back,
    the order rotated and reversed call by call: a config and its baseline are timed seconds apart,
    so a slow spell of a shared machine hits both. With ``bracket`` (and ``none`` among the configs)
    plain decoding also runs right after every other config's call (:func:`call_order`): each call
    then has a plain call just before and just after it (:func:`bracketed`). Engines are built
    in :func:`build_order`, after a spare plain engine that is never called (engines in processes
    of their own; :func:`_build_engines`). ``settle``: seconds of sleep before each call, so the
    engine whose call just ended has stopped spinning: vLLM's shared-memory message queue keeps a
    reader (each idle engine's worker and engine core) busy-looping for a second after its last
    read, and on a CPU
    every engine's worker is bound to the same core. Returns per round, per config and cell, what
    :meth:`_Cell.result` gives (a plain call that only brackets another is not in it); ``calls``,
    when given, gets a record of every call in the order run (:func:`bracketed` reads them).
    ``fresh`` (engines in processes of their own): every round shuts the engines down and builds
    new ones, so each round reads another engine of every config: two engines of one config,
    built one after the other, run at speeds that differ by several percent for as long as they
    live (a plain engine and its A/A twin read 1.061x over a whole run), which rounds over the same
    engines cannot average out. ``warm_up``: every new engine first runs each of the run's calls
    that many times, untimed for the results (:func:`warm_calls`, :func:`_build_engines`; their
    tokens/s go to ``first_calls``)."""
    if fresh and in_process:
        raise ValueError("interleaved: fresh engines are shut down by ending their processes, not with in_process")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # the forward timer goes to each engine's worker as a function (_time_forwards)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    # vLLM's ngram drafts with numba; numba's default threading layer is an OpenMP pool whose
    # threads, once started, contend with torch's own OpenMP pool: every other engine in this
    # process then ran torch's CPU attention kernel (SDPA: dyntree's branching trees) up to ~70x
    # slower. vLLM's ngram drafts on one numba thread here, so its layer does not change its speed.
    os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")
    from vllm import SamplingParams

    sets = _prompt_sets()
    engines: dict[str, Any] = {}
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    out: list[dict[str, dict[str, Any]]] = []
    origin = time.perf_counter()
    for r in range(rounds):
        if r == 0 or fresh:
            warm = warm_calls(sets, batches, warm_up)
            _build_engines(engines, build_order(configs, r, fresh), dtype, sets, warm, params, first_calls,
                           spare=not in_process)
        t = time.time()
        out.append({c: {} for c in configs})
        for cell, prompts, b in _cells(sets, batches):
            acc = {c: _Cell() for c in configs}
            for k, i in enumerate(range(0, len(prompts), b)):
                for c, counted in call_order(configs, r + k, bracket):
                    tally = acc[c] if counted else _Cell()
                    if settle > 0:
                        time.sleep(settle)
                    tokens, wall, start = tally.tokens, tally.wall, time.perf_counter()
                    plain = len(tally.plain_forwards)
                    tally.run(engines[c], prompts[i : i + b], params)
                    if calls is not None:
                        calls.append({"round": r, "cell": cell, "chunk": k, "config": c, "counted": counted,
                                      "start_s": round(start - origin, 3), "tokens": tally.tokens - tokens,
                                      "wall_s": round(tally.wall - wall, 4),
                                      "plain_forward_ms": _median_ms(tally.plain_forwards[plain:])})
            for c in configs:
                out[-1][c][cell] = acc[c].result()
        cells = "  ".join(f"{cell} {v['tokens_per_s'] / out[-1]['none'][cell]['tokens_per_s']:.2f}x"
                          for cell, v in out[-1].get("dyntree", {}).items()) if "none" in configs else ""
        print(f"round {r + 1}/{rounds} ({time.time() - t:.0f} s)  dyntree over none: {cells}", flush=True)
    return out


def warm_calls(sets: dict[str, list[str]], batches: tuple[int, ...], passes: int) -> list[list[str]]:
    """A new engine's untimed calls: every call of the run (each cell's batches, in order), ``passes``
    times over."""
    return [prompts[i : i + b] for _ in range(passes) for _, prompts, b in _cells(sets, batches)
            for i in range(0, len(prompts), b)]


def build_order(configs: list[str], round_: int, fresh: bool = False) -> list[str]:
    """The order a round builds its engines in: engines without speculation first (in one
    process they then keep vLLM's own attention backend), vLLM's ``ngram`` last; with ``fresh``
    engines (processes of their own) that order rotated by the round, so whatever an engine's place
    in the build costs falls on every config in turn (docs/vllm.md: runs that always built plain
    decoding's engine first read it slow against its A/A twin)."""
    build = sorted(configs, key=lambda c: (CONFIGS[c] is not None, c == "vllm_ngram"))
    k = round_ % len(build) if fresh and build else 0
    return build[k:] + build[:k]


def _build_engines(engines: dict[str, Any], configs: list[str], dtype: str, sets: dict[str, list[str]],
                   warm: list[list[str]] | None = None, params: Any = None,
                   first_calls: dict[str, list[list[float]]] | None = None, spare: bool = False) -> None:
    """``engines`` (config -> ``LLM``) built anew for ``configs`` in that order, any there before
    shut down first (their engine-core and worker processes end). With ``spare``, a plain engine
    that is never called is built before them (``engines[SPARE]``), so no config's engine is the
    first built, which runs slow for its whole life (docs/vllm.md). Each new engine then runs the
    ``warm`` calls (prompt lists, at ``params``) untimed for the results: the run's own calls, so
    an adaptive controller has seen every batch size before its first counted call, as a served
    engine has after its first seconds; their tokens/s go to ``first_calls`` (config -> one list
    per build), so what that learning costs stays in the record."""
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()
    engines.clear()
    gc.collect()
    if spare:
        t = time.time()
        engines[SPARE] = _engine("none", dtype, sets)
        print(f"built a spare plain engine, never called ({time.time() - t:.0f} s)", flush=True)
    for c in configs:
        t = time.time()
        engines[c] = _engine(c, dtype, sets)
        rates = []
        for prompts in warm or ():
            tally = _Cell()
            tally.run(engines[c], prompts, params)
            rates.append(round(tally.tokens / tally.wall, 3))
        if first_calls is not None and warm:
            first_calls.setdefault(c, []).append(rates)
        print(f"built {c} ({time.time() - t:.0f} s)" + (f"; first calls at {', '.join(map(str, rates))} tokens/s" if rates else ""),
              flush=True)


def call_order(configs: list[str], shift: int, bracket: bool = False) -> list[tuple[str, bool]]:
    """One ``generate`` call's configs in the order they run, each with whether its call counts
    in the round's tally: every config once, rotated by half of ``shift`` and reversed on odd
    shifts (over ``2 n`` calls of ``n`` configs each takes every place twice, and its neighbours
    change from call to call, so whatever one engine leaves behind for the next call does not
    always fall on the same config); with ``bracket`` (and ``none`` among them) plain decoding
    first and again after every other config, the one plain call that counts moving with
    ``shift`` too (the others only bracket their neighbours; a machine that slows through a slot
    must not favour whichever call comes first)."""
    def turned(xs: list[str]) -> list[str]:
        k = shift // 2 % max(len(xs), 1)
        xs = xs[k:] + xs[:k]
        return xs[::-1] if shift % 2 else xs

    if not bracket or "none" not in configs:
        return [(c, True) for c in turned(configs)]
    others = [c for c in configs if c != "none"]
    counted = shift % (len(others) + 1)  # which of the plain calls counts
    order = [("none", counted == 0)]
    for j, c in enumerate(turned(others)):
        order += [(c, True), ("none", counted == j + 1)]
    return order


def code_version() -> dict[str, Any] | None:
    """The dyntree code a run measures: the git tree of ``dyntree/`` at HEAD and whether the working
    tree changes it (``None`` outside a git checkout), so that runs can be told apart or pooled
    (``vllm_runs.py``)."""
    root = Path(__file__).resolve().parents[1]
    try:
        tree = subprocess.run(["git", "rev-parse", "HEAD:dyntree"], cwd=root, capture_output=True, text=True, check=True)
        status = subprocess.run(["git", "status", "--porcelain", "--", "dyntree"], cwd=root, capture_output=True,
                                text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return {"dyntree_tree": tree.stdout.strip(), "modified": bool(status.stdout.strip())}


def bracketed(calls: list[dict[str, Any]], samples: int = 2000, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Per config, from the records of a ``bracket`` run (:func:`interleaved`): each call's
    tokens/s over the mean of the plain calls right before and right after it in the same
    ``generate`` slot (seconds apart, where a round's plain calls can be minutes apart), the
    geometric mean over its calls and a bootstrap 95% interval, and per cell the median over its
    calls. ``none_sync`` (plain decoding, another engine) is the A/A control, read the same way."""
    import numpy as np

    slots: dict[tuple[int, str, int], list[dict[str, Any]]] = defaultdict(list)
    for x in calls:
        slots[(x["round"], x["cell"], x["chunk"])].append(x)
    logs: dict[str, list[float]] = defaultdict(list)
    cells: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for (_, cell, _), slot in slots.items():
        slot.sort(key=lambda x: x["start_s"])
        rate = [x["tokens"] / x["wall_s"] for x in slot]
        for j, x in enumerate(slot):
            if x["config"] == "none":
                continue
            near = [rate[i] for i in (j - 1, j + 1) if 0 <= i < len(slot) and slot[i]["config"] == "none"]
            if near:
                logs[x["config"]].append(math.log(rate[j] / (sum(near) / len(near))))
                cells[x["config"]][cell].append(logs[x["config"]][-1])
    rng = np.random.default_rng(seed)
    return {c: {**_geometric_mean(v, rng, samples),
                "cells": {cell: round(float(np.exp(np.median(w))), 4) for cell, w in cells[c].items()}}
            for c, v in logs.items()}


def _geometric_mean(logs: list[float], rng: Any, samples: int) -> dict[str, Any]:
    """Calls' log ratios as ``ratio`` (their geometric mean), ``ci95`` (a bootstrap 95% interval
    drawn with ``rng``) and ``calls``."""
    import numpy as np

    x = np.asarray(logs)
    boot = np.exp(x[rng.integers(0, len(x), (samples, len(x)))].mean(axis=1))
    return {"ratio": round(float(np.exp(x.mean())), 4),
            "ci95": [round(float(q), 4) for q in np.percentile(boot, [2.5, 97.5])], "calls": len(x)}


def _outside(run: dict[str, Any]) -> float:
    """A run's seconds outside vLLM's model forward per generated token."""
    return (run["wall_s"] - run["forward_s"]) / run["tokens"]


def _median_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b))


def summarize(rounds: list[dict[str, dict[str, Any]]], configs: list[str]) -> dict[str, Any]:
    """Per config and cell: the rounds' tokens/s, median, spread, tau, speedups and identity."""
    cells = list(rounds[0][configs[0]])
    result: dict[str, Any] = {}
    for c in configs:
        result[c] = {}
        for cell in cells:
            runs = [r[c][cell] for r in rounds]
            tps = [x["tokens_per_s"] for x in runs]
            entry = {"tokens_per_s": [round(x, 3) for x in tps], "median_tokens_per_s": round(statistics.median(tps), 3),
                     "spread": [round(min(tps), 3), round(max(tps), 3)],
                     "tau": round(statistics.median(x["tau"] for x in runs), 3),
                     "drafting_steps": int(statistics.median(x["drafting_steps"] for x in runs))}
            plain = [x["plain_forward_ms"] for x in runs if x.get("plain_forward_ms") is not None]
            if plain:  # this config's engines' speed at the same work as plain decoding's
                entry["plain_forward_ms"] = round(statistics.median(plain), 3)
            for base in ("none", "none_sync", "vllm_ngram"):
                if base in configs and base != c:
                    entry[f"speedup_vs_{base}"] = round(_median_ratio(tps, [r[base][cell]["tokens_per_s"] for r in rounds]), 4)
            if "none" in configs and c != "none" and all(x.get("forward_s") for x in runs):
                entry["outside_forward_vs_none"] = round(statistics.median(
                    (_outside(x) - _outside(r["none"][cell])) * r["none"][cell]["tokens"] / r["none"][cell]["wall_s"]
                    for x, r in zip(runs, rounds)), 4)
            if "none" in configs:
                plain = rounds[0]["none"][cell]["outputs"]
                entry["identical_to_none"] = round(sum(x == y for x, y in zip(runs[0]["outputs"], plain)) / len(plain), 4)
            result[c][cell] = entry
    return result


def pooled(configs: dict[str, dict[str, Any]], samples: int = 2000, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Every call of a config (each cell and round) pooled, from :func:`summarize`'s per-round
    tokens/s: the geometric mean of the call's tokens/s over plain decoding's in the same cell and
    round (the mean of ``none`` and ``none_sync`` where the run has both; ``none_sync`` itself over
    ``none``: the A/A control), with a bootstrap 95% interval over the calls. Single calls at
    batch 8 and 16 can move by a third on a shared 2-core machine; a per-cell median of 3-5
    rounds cannot resolve a few percent, the pooled ratio of all calls can say more."""
    import numpy as np

    if "none" not in configs:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for c, cells in configs.items():
        if c == "none":
            continue
        logs = []
        for cell, entry in cells.items():
            for i, tps in enumerate(entry["tokens_per_s"]):
                bases = [configs[b][cell]["tokens_per_s"][i] for b in ("none", "none_sync")
                         if b in configs and b != c and (c != "none_sync" or b == "none")]
                logs.append(math.log(tps / (sum(bases) / len(bases))))
        out[c] = {**_geometric_mean(logs, np.random.default_rng(seed), samples),
                  "over": "none" if c == "none_sync" or "none_sync" not in configs else "mean of none and none_sync"}
    return out


def _plot(doc: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return
    configs = [c for c in doc["configs"] if c != "none"]
    cells = list(doc["configs"]["none"])
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(cells)), 4.5))
    width = 0.8 / len(configs)
    for k, c in enumerate(configs):
        vals = [doc["configs"][c][cell]["speedup_vs_none"] for cell in cells]
        ax.bar([i + k * width for i in range(len(cells))], vals, width, label=c, color=plt.cm.tab10(k))
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))], cells)
    ax.set_ylabel("tokens/s over no speculation\n(" + ("median of calls, each over the plain calls around it"
                                                        if "bracketed" in doc else "median of rounds") + ")", fontsize=9)
    ax.set_title(f"vLLM {doc['versions']['vllm']} on {doc['cpu']} ({doc['dtype']}), SmolLM2-135M, greedy")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def preload_libraries() -> list[str]:
    """What vLLM's CPU install guide puts in ``LD_PRELOAD``: tcmalloc (the system's, e.g. Debian's
    ``libtcmalloc-minimal4``) and Intel's OpenMP runtime (``libiomp5.so``, which the ``intel-openmp``
    wheel installs under the environment's ``lib``); vLLM's CPU worker warns when either is missing
    (without Intel's runtime, for speculative decoding). Raises ``FileNotFoundError`` naming what is
    not installed."""
    import ctypes.util
    import glob
    import sys

    found = []
    for name, candidates in (
            ("tcmalloc (apt install libtcmalloc-minimal4)",
             [ctypes.util.find_library("tcmalloc_minimal"), ctypes.util.find_library("tcmalloc"),
              *sorted(glob.glob("/usr/lib/*-linux-gnu/libtcmalloc_minimal.so*"))]),
            ("Intel OpenMP (pip install intel-openmp)", sorted(glob.glob(os.path.join(sys.prefix, "lib", "libiomp5.so"))))):
        path = next((c for c in candidates if c), None)
        if path is None:
            raise FileNotFoundError(f"{name} is not installed")
        found.append(path)
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="default: benchmarks/results/vllm/<machine>_<dtype>.json")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto", help="auto (bf16 on a CPU with native bf16, else fp32) | bfloat16 | float32")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join([*CONFIGS, *CONTROLS])}")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)), help="of 1, 8, 16 (default: all)")
    ap.add_argument("--bracket", action="store_true",
                    help="plain decoding also right after every other config's call, each call read over its two "
                         "plain neighbours (bracketed in the JSON; see bracketed())")
    ap.add_argument("--settle", type=float, default=0.0,
                    help="seconds to wait before each generate call, past vLLM's 1 s busy-loop of the engine "
                         "whose call just ended (see interleaved()); default 0")
    ap.add_argument("--preload", action="store_true",
                    help="run the engines with the libraries vLLM's CPU install guide preloads (tcmalloc and Intel "
                         "OpenMP, see preload_libraries()); default: vLLM's own preload (PyTorch's libgomp)")
    ap.add_argument("--fresh-engines", action="store_true",
                    help="build every config's engine anew at each round (see interleaved()); default: one engine "
                         "per config for the whole run")
    ap.add_argument("--warm-up", type=int, nargs="?", const=1, default=0, metavar="PASSES",
                    help="every new engine first runs each of the run's calls PASSES times (1 if not given), untimed "
                         "for the results (their tokens/s are in the JSON as first_calls); default: one short pass "
                         "over both prompt sets")
    ap.add_argument("--in-process", action="store_true",
                    help="every config's engine in this one process (default: each in processes of its own; see interleaved())")
    args = ap.parse_args()
    import torch

    from dyntree.models import machine_kind, pick_dtype

    if args.dtype == "auto":
        args.dtype = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[pick_dtype("auto", torch.device("cpu"))[0]]
    batches = tuple(int(b) for b in args.batches.split(","))
    if not batches or any(b not in BATCHES for b in batches):
        ap.error(f"--batches: choose from {', '.join(map(str, BATCHES))}")
    CONFIGS.update((c, CONTROLS[c]) for c in args.configs.split(",") if c in CONTROLS)
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; choose from {', '.join({**CONFIGS, **CONTROLS})}")
    short = {"bfloat16": "bf16", "float32": "fp32"}[args.dtype]
    out = Path(args.out or ROOT / "benchmarks" / "results" / "vllm" / f"{machine_kind()}_{short}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    if args.bracket and "none" not in configs:
        ap.error("--bracket: brackets every call with plain decoding, so --configs must include none")
    if args.settle < 0:
        ap.error("--settle: seconds >= 0")
    if args.warm_up < 0:
        ap.error("--warm-up: passes >= 0")
    if args.fresh_engines and args.in_process:
        ap.error("--fresh-engines: engines are shut down by ending their processes, so not with --in-process")
    if args.preload:
        if args.in_process:
            ap.error("--preload: the libraries load when an engine's process starts, so not with --in-process")
        try:
            os.environ["LD_PRELOAD"] = ":".join(preload_libraries())
        except FileNotFoundError as e:
            ap.error(f"--preload: {e}")
        print(f"engines run with LD_PRELOAD={os.environ['LD_PRELOAD']}", flush=True)
    calls: list[dict[str, Any]] = []
    first_calls: dict[str, list[list[float]]] = {}
    code = code_version()
    rounds = interleaved(configs, args.dtype, args.max_tokens, args.rounds, batches, args.in_process, args.bracket, calls,
                         args.settle, args.fresh_engines, args.warm_up, first_calls)
    import vllm

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    doc: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_kind(), "cpu": cpu,
        "cores": os.cpu_count(), "dtype": short, "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
        "code": code, "model": "SmolLM2-135M-Instruct", "max_tokens": args.max_tokens, "rounds": args.rounds, "batches": list(batches),
        "mode": ("in-process: every engine in one process" if args.in_process
                 else "engines: every config's engine in processes of its own (vLLM's multiprocess engine core), "
                     "after a spare plain engine that is never called")
                + (", built anew at each round (--fresh-engines)" if args.fresh_engines else "")
                + ", all alive at once, each generate call run by every config back to back"
                + (", plain decoding again after every other config's call (--bracket)" if args.bracket else "")
                + (f", {args.settle:g} s of sleep before each call (--settle)" if args.settle else "")
                + (f", every new engine first ran each call {'once' if args.warm_up == 1 else f'{args.warm_up} times'}, "
                   "untimed (--warm-up; first_calls)" if args.warm_up else "")
                + (", engines with tcmalloc and Intel OpenMP preloaded (--preload)" if args.preload else ""),
        "ld_preload": os.environ.get("LD_PRELOAD", "") if args.preload else None,
        "prompts": {name: [r["question_id"] for r in rows] for name, rows in prompt_rows().items()},
        "speculative_configs": {c: CONFIGS[c] for c in configs}, "wall_s": round(time.time() - started),
        "configs": summarize(rounds, configs),
    }
    if first_calls:  # tokens/s of each new engine's untimed first calls (--warm-up), per build
        doc["first_calls"] = first_calls
    if args.bracket:  # each call over its own plain neighbours; the cells' speedups read the same way
        doc["bracketed"] = bracketed(calls)
        doc["calls"] = calls
        for c, v in doc["bracketed"].items():
            for cell, ratio in v["cells"].items():
                doc["configs"][c][cell]["speedup_vs_none"] = ratio
    doc["pooled"] = pooled(doc["configs"])
    if "none" in configs and "dyntree" in configs:
        doc["summary"] = {
            f"{cell}: default dyntree": (f"{v['speedup_vs_none']:.2f}x none"
                                         + (f", {v['speedup_vs_none_sync']:.2f}x none_sync"
                                            if "speedup_vs_none_sync" in v else "")
                                         + (f", {v['speedup_vs_vllm_ngram']:.2f}x vLLM ngram" if "speedup_vs_vllm_ngram" in v else ""))
            for cell, v in doc["configs"]["dyntree"].items()}
        if any(not cell.endswith("/b1") for cell in doc["configs"]["none"]):  # batch 8 / 16: every call pooled too
            doc["summary"].update({f"pooled: {c}": f"{v['ratio']:.3f}x [{v['ci95'][0]:.3f}, {v['ci95'][1]:.3f}] over {v['over']}"
                                   for c, v in doc.get("pooled", {}).items()})
    doc.setdefault("summary", {}).update({
        f"bracketed: {c}": f"{v['ratio']:.3f}x [{v['ci95'][0]:.3f}, {v['ci95'][1]:.3f}] over the plain calls around it "
                           f"({v['calls']} calls)" for c, v in doc.get("bracketed", {}).items()})
    out.write_text(json.dumps(doc, indent=1) + "\n")
    _plot(doc, out.with_suffix(".png"))
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
