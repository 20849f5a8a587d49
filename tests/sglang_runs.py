"""Runs the DYNTREE SGLang worker on SmolLM2 against the CPU stand-in of SGLang's scheduler and
target (:mod:`sglang_standin`), and plain greedy decoding of the same prompts, then writes the
tokens as JSON. A separate process: SGLang's worker modules import only with the torchvision stub
(``tests/sglang_stub``) on ``PYTHONPATH``, which must not leak into pytest's own process.

    PYTHONPATH=tests/sglang_stub:tests python tests/sglang_runs.py CASES.json OUT.json

CASES.json: ``{"prompts": [[ids...], ...], "max_new": 32, "runs": [{"name", "options", "flags",
"ablate", "mask_mode", "chunked", "limit", "max_new", "copies", "sampling", "prompts", "pool_size"}]}``;
``options`` is the DYNTREE options file's object, ``flags`` SGLang's ``--speculative-*`` values (by
field name); ``limit`` and ``max_new`` run a run on the first prompts only, for fewer tokens;
``copies`` repeats them (many samples of one prompt) and ``sampling`` sets the requests'
temperature / top_p / top_k; ``prompts`` replaces the case's prompts. A sampled run's output has
``next_token_logits``: the target's logits after its first prompt and that prompt's greedy token.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from types import SimpleNamespace

import torch


def plain_greedy(model: torch.nn.Module, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Reference: transformers' forward with its own KV cache, one request at a time, argmax."""
    from transformers import DynamicCache

    outs = []
    with torch.inference_mode():
        for p in prompts:
            cache, ids, toks = DynamicCache(), torch.tensor([p]), []
            for _ in range(max_new):
                logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
                toks.append(int(logits.argmax()))
                ids = torch.tensor([[toks[-1]]])
            outs.append(toks)
    return outs


def next_token_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """The target's logits after ``prompt`` + its greedy next token (a sampled first decode step's
    distribution, before temperature and top-p)."""
    with torch.inference_mode():
        first = int(model(input_ids=torch.tensor([prompt])).logits[0, -1].argmax())
        return model(input_ids=torch.tensor([prompt + [first]])).logits[0, -1].float()


def main(cases_path: str, out_path: str) -> None:
    from sglang_standin import TokenPoolTarget, run_scheduler

    from dyntree.models import load_model, model_path
    from dyntree.sglang_plugin.options import ENV
    from dyntree.sglang_plugin.worker import DynTreeWorker

    torch.manual_seed(0)
    cases = json.load(open(cases_path))
    prompts, max_new = cases["prompts"], cases["max_new"]
    model, _ = load_model("smollm2", torch.float32)
    path = str(model_path("smollm2"))
    results: dict = {}
    t = time.time()
    results["plain"] = {"tokens": plain_greedy(model, prompts, max_new), "seconds": time.time() - t}
    for run in cases["runs"]:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(run.get("options", {}), f)
        os.environ[ENV] = f.name
        flags = {"speculative_num_draft_tokens": None, "speculative_num_steps": None, "speculative_eagle_topk": None,
                 "speculative_draft_model_path": None, "speculative_draft_model_quantization": None}
        flags.update(run.get("flags", {}))
        server_args = SimpleNamespace(model_path=path, tokenizer_path=path, random_seed=0, **flags)
        some = run.get("prompts", prompts)[: run.get("limit", len(prompts))] * run.get("copies", 1)
        target = TokenPoolTarget(model, pool_size=run.get("pool_size", 6144), max_reqs=len(some))
        worker = DynTreeWorker(server_args=server_args, gpu_id=0, nccl_port=0, target_worker=target)
        worker.alloc_memory_pool()
        worker.ablate = frozenset(run.get("ablate", []))
        if run.get("mask_mode"):
            worker.mask_mode = run["mask_mode"]
        t = time.time()
        out = run_scheduler(worker, target, some, run.get("max_new", max_new), chunked=run.get("chunked", False),
                            sampling=run.get("sampling"))
        out.update(seconds=time.time() - t, drafter=worker.speculator.drafter.name, width=worker.width,
                   widths=sorted(worker.widths.elements()), adaptive=worker.speculator.controller is not None)
        if run.get("sampling"):
            out["next_token_logits"] = next_token_logits(model, some[0]).tolist()
        results[run["name"]] = out
        os.unlink(f.name)
    json.dump(results, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
