"""Runs vLLM (offline ``LLM``) on SmolLM2 for the vLLM plugin tests, one engine after another in
one process, and writes what each produced as JSON (kept out of pytest's process: vLLM spawns
engine processes and reads the environment when it does).

    python tests/vllm_runs.py RUNS.json OUT.json

RUNS.json: a list of ``{"name", "speculative_config", "ablate", "llm", "sampling", "prompts"}``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

if __name__ == "__main__":
    runs_path, out_path = sys.argv[1], sys.argv[2]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from dyntree.models import model_path

    results = {}
    for run in json.load(open(runs_path)):
        os.environ["DYNTREE_VLLM_ABLATE"] = run.get("ablate", "")
        start = time.time()
        llm = LLM(model=str(model_path("smollm2")), dtype="float32", max_model_len=1024, enforce_eager=True,
                  seed=0, disable_log_stats=False, speculative_config=run.get("speculative_config"), **run.get("llm", {}))
        ready = time.time()
        outs = llm.generate(run["prompts"], SamplingParams(**run["sampling"]), use_tqdm=False)
        done = time.time()
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics() 
                   if m.name.startswith(("vllm:spec_decode", "vllm:num_preemptions"))}
        results[run["name"]] = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                                "texts": [o.outputs[0].text for o in outs], "init_s": ready - start,
                                "generate_s": done - ready, "metrics": metrics}
        del llm
        gc.collect()
        json.dump(results, open(out_path, "w"))
        print(f"{run['name']}: {ready - start:.1f} s start, {done - ready:.1f} s generate", flush=True)
